"""The gradient noise scale of every run (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
appendix A.1): the batch beyond which a larger one buys little, B_simple = tr(Sigma) / |G|^2.

Each optimizer step gives two measurements: the squared norm of small-batch gradients (each micro-batch's on each rank,
seen by a hook on every weight before DeepSpeed adds it up or reduces it; with one rank and no accumulation, each half
of a micro-batch split for it) and that of the step's gradient over the global batch. Their unbiased combinations
estimate |G|^2 and tr(Sigma); each is averaged over a log interval's measured steps on every rank, then smoothed over
the log points (the ratio of two noisy estimates is biased: numerator and denominator are smoothed apart). Only the
first eighth of each log interval's steps (its first step at least) are measured: the others run without the hooks'
work and unsplit. Nothing here reads the device between log points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

SMOOTHING = 0.8  # the weight of the past in the log points' moving averages
SHARE = 8  # one step in this many is measured (the first steps of each log interval)


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """One log point's estimates, smoothed: |G|^2, tr(Sigma) and their ratio (None until |G|^2 is positive)."""

    grad_sq: float
    trace: float
    b_simple: float | None

    def scalars(self) -> dict[str, float]:
        values = {"noise/grad_sq": self.grad_sq, "noise/trace_sigma": self.trace}
        return values | ({"noise/b_simple": self.b_simple} if self.b_simple is not None else {})


def estimates(small_sq: float, big_sq: float, *, small: int, big: int) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) from the mean squared gradient norm of batches of ``small`` samples and that of ``big``."""
    grad_sq = (big * big_sq - small * small_sq) / (big - small)
    trace = (small_sq - big_sq) / (1 / small - 1 / big)
    return grad_sq, trace


class NoiseScale:
    """Hooks on ``module``'s weights that measure each small batch's gradient; ``micro_batch`` around each backward,
    ``step_done`` after each optimizer step, ``report`` at log points (every rank: one small reduction)."""

    def __init__(self, module: torch.nn.Module, *, small: int, big: int, device: torch.device) -> None:
        self.small, self.big, self.device = small, big, device
        self._squares: list[torch.Tensor] = []  # this backward's, one per weight
        self._scale = 1.0  # what the hooked gradients are multiplied by in this backward
        self._micro: list[torch.Tensor] = []  # this step's small batches' squared norms
        self._sums = torch.zeros(3, dtype=torch.float64, device=device)  # small, big, steps since the last report
        self._smoothed: tuple[float, float] | None = None
        self._active = False  # inside ``micro_batch``: the hooks measure
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(self._seen)

    @staticmethod
    def measures(step: int, *, every: int) -> bool:
        """Whether the optimizer step after ``step`` is measured: the first eighth of each interval of ``every``
        steps, its first at least."""
        return step % every < max(1, every // SHARE)

    def _seen(self, grad: torch.Tensor) -> None:
        if self._active:
            self._squares.append(torch.linalg.vector_norm(grad, dtype=torch.float32).square())

    def micro_batch(self, scale: float) -> _Backward:
        """Around one backward whose gradients are ``scale`` times its batch's mean gradient (the loss scale, over the
        accumulation steps and the pieces of a split micro-batch)."""
        return _Backward(self, scale)

    def step_done(self, big_norm: torch.Tensor | float | None, *, applied: bool) -> None:
        """The step's gradient norm over the global batch (unscaled); a step not applied (skipped for overflow, or
        all its micro-batches skipped) is left out."""
        micro, self._micro = self._micro, []
        if not applied or big_norm is None or not micro:
            return
        big_sq = torch.as_tensor(big_norm, dtype=torch.float64, device=self.device).square()
        small_sq = torch.stack(micro).double().mean()
        self._sums += torch.stack([small_sq, big_sq, torch.ones((), dtype=torch.float64, device=self.device)])

    def report(self) -> Estimate | None:
        """The smoothed estimates up to this log point, over every rank; None before the first applied step."""
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        torch_dist.all_reduce(sums)
        small_sum, big_sum, steps = sums.tolist()
        now = estimates(small_sum / steps, big_sum / steps, small=self.small, big=self.big) if steps else None
        if now is not None and all(math.isfinite(v) for v in now):  # an interval of overflowing steps: left out
            past = self._smoothed or now
            self._smoothed = tuple(SMOOTHING * p + (1 - SMOOTHING) * n for p, n in zip(past, now, strict=True))
        if self._smoothed is None:
            return None
        grad_sq, trace = self._smoothed
        return Estimate(grad_sq=grad_sq, trace=trace, b_simple=trace / grad_sq if grad_sq > 0 else None)


class _Backward:
    def __init__(self, noise: NoiseScale, scale: float) -> None:
        self.noise, self.scale = noise, scale

    def __enter__(self) -> None:
        self.noise._squares, self.noise._active = [], True

    def __exit__(self, *exc: Any) -> None:
        noise = self.noise
        if exc[0] is None and noise._squares:
            noise._micro.append(torch.stack(noise._squares).sum() / self.scale**2)
        noise._squares, noise._active = [], False


def at_step(noise: NoiseScale | None, pieces: int, *, step: int, every: int) -> tuple[NoiseScale | None, int]:
    """What the optimizer step after ``step`` passes to ``train_step`` as ``noise`` and ``pieces``: the measurement
    and the micro-batch's split on a measured step, neither on the others (the step unsplit, the hooks idle)."""
    if noise is None or not noise.measures(step, every=every):
        return None, 1
    return noise, pieces


def for_run(engine: Any, *, asked: bool) -> tuple[NoiseScale | None, int, str]:
    """The noise scale a run measures: the measurement (or None), the parts each micro-batch is split into for it, and
    what to say of it. Small batches are each rank's micro-batches, or with one rank and no accumulation each half."""
    micro, big = engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()
    if not asked:
        return None, 1, "noise scale: off (noise_scale: false)"
    if big > micro:
        noise = NoiseScale(engine.module, small=micro, big=big, device=engine.device)
        return noise, 1, f"noise scale: from {big // micro} micro-batches of {micro} against their step's {big}"
    if micro % 2:
        return None, 1, f"noise scale: off (one rank, no accumulation, and micro-batch {micro} does not split in two)"
    noise = NoiseScale(engine.module, small=micro // 2, big=big, device=engine.device)
    return noise, 2, f"noise scale: from the halves of each micro-batch of {micro} (one rank, no accumulation)"
