"""Our learning-rate schedule: batch-size scaling, linear warm-up, cosine decay to end_lr.

Step ``t`` (1-based) is the optimizer step about to be taken. The peak is
``start_lr * s`` with ``s = sqrt(global / base)``, ``global / base`` or 1 by ``scaling``. When
warm-up applies (the reference's rule: scaling is not 'none' and global > base), steps 1..W rise
linearly to the peak, ``peak * t / W``. Then the cosine runs from the peak to ``end_lr``:
``end + (peak - end) (1 + cos(pi (t - W) / (T - W))) / 2``, which is ``end_lr`` exactly at the last
step ``t = T``. (The reference's cosine runs over T steps after warm-up and ends above end_lr.)

The object follows torch's scheduler protocol as DeepSpeed uses it: DeepSpeed calls ``step()`` after
each optimizer step and saves ``state_dict()`` in its checkpoints. It does not call it after a step it
skipped (gradients that overflowed under fp16, or were not finite under bf16); ``follow(engine)`` counts
those too, at the next applied step, so that the schedule is back at the engine's step: step ``t`` uses
the lr of step ``t``, except the step right after a skipped one, which uses the skipped step's; the run
reaches ``end_lr`` at its last step. (Counting only the applied steps would leave the schedule behind by
every skipped step, short of ``end_lr`` at the end of training.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer


def peak_lr(start_lr: float, scaling: str, global_batch: int, *, base_batch: int) -> float:
    factor = {"sqrt": math.sqrt(global_batch / base_batch), "linear": global_batch / base_batch, "none": 1.0}
    return start_lr * factor[scaling]


def warmup_applies(scaling: str, global_batch: int, base_batch: int) -> bool:
    return scaling != "none" and global_batch > base_batch


class ScaledCosineSchedule:
    def __init__(
        self,
        optimizer: Optimizer,
        *,
        start_lr: float,
        end_lr: float,
        warmup_steps: int,
        total_steps: int,
        scaling: str,
        global_batch: int,
        base_batch: int,
    ) -> None:
        self.optimizer = optimizer
        self.peak = peak_lr(start_lr, scaling, global_batch, base_batch=base_batch)
        self.end_lr = end_lr
        self.warmup_steps = warmup_steps if warmup_applies(scaling, global_batch, base_batch) else 0
        self.total_steps = total_steps
        if total_steps < 1 or self.warmup_steps >= total_steps:
            raise ValueError(f"warm-up of {self.warmup_steps} steps does not fit in {total_steps} total steps")
        self.steps_taken = 0
        self.skipped_counted = 0
        self._skipped_steps: Callable[[], int] | None = None
        self._apply()

    def follow(self, engine: Any) -> None:
        """Count the steps ``engine`` skips (its ``skipped_steps``) as steps taken."""
        self._skipped_steps = lambda: int(engine.skipped_steps)

    def lr_at(self, t: int) -> float:
        """Learning rate of optimizer step ``t`` (1-based); end_lr beyond the last step."""
        if self.warmup_steps and t <= self.warmup_steps:
            return self.peak * t / self.warmup_steps
        progress = min(1.0, (t - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.end_lr + 0.5 * (self.peak - self.end_lr) * (1 + math.cos(math.pi * progress))

    def _apply(self) -> None:
        lr = self.lr_at(self.steps_taken + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """After an applied optimizer step: that step, and any skipped since the last one, are taken."""
        skipped = self._skipped_steps() if self._skipped_steps is not None else self.skipped_counted
        self.steps_taken += 1 + skipped - self.skipped_counted
        self.skipped_counted = skipped
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"steps_taken": self.steps_taken, "skipped_counted": self.skipped_counted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_taken = int(state["steps_taken"])
        self.skipped_counted = int(state.get("skipped_counted", 0))  # checkpoints from before it was counted: 0
        self._apply()
