"""Our learning-rate schedule: batch-size scaling, linear warm-up, cosine decay to end_lr (docs/training.md).

The peak is ``start_lr`` times sqrt(global / base), global / base or 1 (``scaling``); warm-up applies, as in the
reference, where scaling is not 'none' and global > base. DeepSpeed steps the object after each optimizer step and
saves it in its checkpoints; ``follow(engine)`` counts the steps DeepSpeed skipped, so that the run reaches
``end_lr`` at its last step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from torch.optim import Optimizer

from trainer.config import LRSchedule


class Schedule(Protocol):
    """What the trainer, the learning watch and DeepSpeed ask of a learning-rate schedule: DeepSpeed calls ``step``
    after each applied optimizer step and saves ``state_dict`` in its checkpoints."""

    peak: float  # the largest learning rate of the run
    steps_taken: int  # optimizer steps taken, skipped ones included

    def lr_at(self, t: int) -> float:
        """The learning rate of optimizer step ``t`` (1-based)."""

    def follow(self, engine: Any) -> None:
        """Count the steps ``engine`` skips (fp16 overflow) as taken."""

    def step(self) -> None: ...

    def get_last_lr(self) -> list[float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def peak_lr(start_lr: float, scaling: str, global_batch: int, *, base_batch: int) -> float:
    factor = {"sqrt": math.sqrt(global_batch / base_batch), "linear": global_batch / base_batch, "none": 1.0}
    return start_lr * factor[scaling]


def warmup_applies(scaling: str, global_batch: int, base_batch: int) -> bool:
    return scaling != "none" and global_batch > base_batch


class ScaledCosineSchedule:
    """Warm-up (where it applies), then cosine decay from the scaled peak to ``end_lr`` at ``total_steps``."""

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


def make_schedule(
    optimizer: Optimizer, settings: LRSchedule, *, total_steps: int, global_batch: int, base_batch: int
) -> Schedule:
    """The schedule the config's ``lr_schedule`` section asks for, over ``total_steps`` optimizer steps: the one place
    a schedule is made (another shape is a class following ``Schedule``, chosen here by a key of that section)."""
    return ScaledCosineSchedule(
        optimizer,
        start_lr=settings.start_lr,
        end_lr=settings.end_lr,
        warmup_steps=settings.warmup_steps,
        total_steps=total_steps,
        scaling=settings.scaling,
        global_batch=global_batch,
        base_batch=base_batch,
    )
