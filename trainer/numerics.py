"""Whether a run learns, said at every log point: the gradient norm, fp16's loss scale, the steps skipped for
overflow, and whether the applied steps changed the weights, with one clear warning when they show it does not.

A run whose gradients are all zero (fp16 gradients that underflow), or whose every step is skipped, otherwise looks
like one that learns slowly. Nothing here reads the device between log points: the gradient norm of each optimizer
step stays on the device, and the weights are summed only at log points, where the trainer synchronizes anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.loss_scaling import loss_scale

log = logging.getLogger(__name__)

# The share of skipped steps that is not loss-scale probing, and the steps it is measured over. After fp16's initial
# search (from 2^initial_scale_power down to a scale that fits, one or two skipped steps per halving), DeepSpeed's
# dynamic scale overflows again only when it tries to double, once per loss_scale_window (1000) clean steps: far
# below 1%. A quarter of 20 steps or more means gradients overflow whatever the scale (non-finite values from the
# model itself, or the scale at its floor, min_loss_scale).
SKIPPED_SHARE = 0.25
SKIPPED_WINDOW_STEPS = 20


# Steps whose learning rate is below this share of the peak may leave the weights as they are (the last steps of
# the cosine, the first of a long warm-up): the weights are expected to change only over steps that reach it.
MOVING_LR_SHARE = 1e-3


def optimizer_weights(engine: Any) -> list[torch.Tensor]:
    """The weights the optimizer updates: the float32 master copies under fp16 and bf16 (this rank's partition under
    ZeRO), the model's own parameters in fp32. A step too small to change a float16 weight changes these."""
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def weight_digest(weights: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the float64 sum and sum of squares of the weights: equal digests mean unchanged weights (a change
    of one float32 ulp moves a float64 sum). Two passes over the weights, and one device sync."""
    sums = [torch.stack([w.detach().sum(dtype=torch.float64), w.detach().double().square().sum()]) for w in weights]
    return torch.stack(sums).cpu()


def step_gradient_norm(engine: Any) -> torch.Tensor | None:
    """Between the step's last backward and its optimizer step: the norm of the gradients the optimizer is about to
    take, unscaled, on the device, where the model's parameters hold them (ZeRO stage 0); else None (ZeRO's partitions,
    and the gradients bf16's optimizer moved aside, are DeepSpeed's to measure: ``engine.get_global_grad_norm()``)."""
    if engine.zero_optimization():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    scale = loss_scale(engine)
    return norm if scale is None else norm / scale


@dataclass(kw_only=True)
class Report:
    """What one log point says about the steps since the last one."""

    grad_norm: float | None  # of the last optimizer step's gradients, unscaled; None where not measured
    loss_scale: float | None  # fp16 only
    skipped: int  # steps skipped for overflow since the last log point
    weights_changed: bool | None  # None where no step was applied since the last log point

    def console(self) -> str:
        parts = [] if self.grad_norm is None else [f"grad norm {self.grad_norm:.3g}"]
        if self.loss_scale is not None:
            parts.append(f"loss scale {self.loss_scale:g}")
        parts.append(f"{self.skipped} skipped" + (" for overflow" if self.skipped else ""))
        return ", ".join(parts)


class LearningWatch:
    """Watches one engine through a run. ``after_backward`` is called at every step's end with the gradient norm (on
    the device); ``report`` at every log point. ``lr_at(step)`` is the learning rate of an optimizer step (1-based),
    ``peak_lr`` the schedule's largest."""

    def __init__(self, engine: Any, lr_at: Callable[[int], float], peak_lr: float, *, warn: bool = True) -> None:
        self.engine, self.lr_at, self.peak_lr, self.warn = engine, lr_at, peak_lr, warn
        self.digest = self.start_digest = weight_digest(optimizer_weights(engine))
        self.steps, self.skipped = engine.global_steps, engine.skipped_steps
        self._grad_norm: torch.Tensor | None = None
        # fp16's scale searches from wherever it starts, here or after a resume: up to the first applied step
        self._searching = engine.fp16_enabled()
        self._window_steps = self._window_skipped = 0
        self._warned: set[str] = set()

    def after_backward(self, norm: torch.Tensor | None) -> None:
        """Between the step's last backward and its optimizer step: ``norm`` is ``step_gradient_norm``'s."""
        if norm is not None:
            self._grad_norm = norm

    def _last_grad_norm(self) -> float | None:
        if self._grad_norm is not None:
            return float(self._grad_norm)
        norm = self.engine.get_global_grad_norm()  # DeepSpeed's, under ZeRO (unscaled there)
        return None if norm is None else float(norm)

    def report(self) -> Report:
        """The log point's numbers, with a warning (once per kind and run) where they show the run is not learning."""
        engine = self.engine
        steps, skipped = engine.global_steps - self.steps, engine.skipped_steps - self.skipped
        self.steps, self.skipped = engine.global_steps, engine.skipped_steps
        applied = steps - skipped
        changed = None
        if applied:
            digest = weight_digest(optimizer_weights(engine))
            changed = not torch.equal(digest, self.digest)
            self.digest = digest
        report = Report(
            grad_norm=self._last_grad_norm(), loss_scale=loss_scale(engine), skipped=skipped, weights_changed=changed
        )
        moving = max(
            (self.lr_at(t) for t in range(engine.global_steps - steps + 1, engine.global_steps + 1)), default=0
        )
        frozen = applied and not changed and moving >= MOVING_LR_SHARE * self.peak_lr
        if frozen or report.grad_norm == 0.0:
            what = [f"the weights did not change over the {applied} optimizer step(s) applied"] if frozen else []
            what += ["the gradient norm is 0"] if report.grad_norm == 0.0 else []
            hint = " (float16 gradients that underflow give this)" if report.loss_scale is not None else ""
            self._warn(
                "learning",
                "%s up to step %d (lr up to %.3g, %s): this run is not learning%s",
                " and ".join(what),
                engine.global_steps,
                moving,
                report.console(),
                hint,
            )
        self._count_skipped(steps, skipped, report)
        return report

    def _count_skipped(self, steps: int, skipped: int, report: Report) -> None:
        """Skipped steps after fp16's loss-scale search (from the scale the run starts or resumes with; it ends at
        the first applied step), in windows of SKIPPED_WINDOW_STEPS or more."""
        if self._searching:
            if steps == skipped:  # nothing applied yet: all of it was the search
                return
            self._searching = False
            steps, skipped = steps - skipped, 0  # this interval's applied steps, which came after the search
        self._window_steps += steps
        self._window_skipped += skipped
        if self._window_steps < SKIPPED_WINDOW_STEPS:
            return
        if self._window_skipped > SKIPPED_SHARE * self._window_steps:
            self._warn(
                "skipping",
                "%d of the last %d optimizer steps were skipped for overflow (up to step %d, %s): the gradients "
                "overflow whatever the loss scale",
                self._window_skipped,
                self._window_steps,
                self.engine.global_steps,
                report.console(),
            )
        self._window_steps = self._window_skipped = 0

    def _warn(self, kind: str, message: str, *args: Any) -> None:
        if self.warn and kind not in self._warned:
            self._warned.add(kind)
            log.warning(message, *args)

    def weights_changed(self) -> bool:
        """Whether the weights differ from those the watch started with."""
        return not torch.equal(weight_digest(optimizer_weights(self.engine)), self.start_digest)
