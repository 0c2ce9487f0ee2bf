"""One optimizer step, the only one: ``train_step``, which the training loop, the benchmark's timed steps and the
tests run; and ``StepGuard``, through which the ranks agree between steps on what to do next.

Each phase is a named range: ``torch.profiler`` records it (``--profile``), and on a GPU it is also an NVTX range,
so that ``nsys profile`` shows data wait, forward, backward and optimizer step on its timeline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist

from model import Loss
from pipeline.volumes import DataError
from trainer.config.sections import Faults
from trainer.errors import NumericalError
from trainer.loss_scaling import backward, loss_scale
from trainer.noise import NoiseScale
from trainer.numerics import step_gradient_norm
from trainer.preemption import StopRequest
from trainer.reduction import OverlappedReduction

log = logging.getLogger(__name__)

# Names of the ranges, in the order a step passes them.
PHASES = ("data_wait", "forward", "backward", "optimizer_step")


class PhaseClock(Protocol):
    """Told where each phase begins and ends (the benchmark's timers)."""

    def begin(self, name: str) -> None: ...

    def end(self, name: str) -> None: ...


_clock: PhaseClock | None = None


@contextlib.contextmanager
def clocked(clock: PhaseClock) -> Iterator[None]:
    """Within the block, every ``phase`` tells ``clock`` where it begins and ends."""
    global _clock
    previous, _clock = _clock, clock
    try:
        yield
    finally:
        _clock = previous


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A range named ``name`` for torch.profiler, for NVTX (nsys) on a GPU, and for the clock of ``clocked``."""
    nvtx, clock = torch.cuda.is_initialized(), _clock  # a process that uses its GPU; cheap to ask on every phase
    if clock is not None:
        clock.begin(name)
    with torch.profiler.record_function(name):
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()
    if clock is not None:
        clock.end(name)


@dataclass(kw_only=True)
class StepResult:
    """What one optimizer step did: the losses of its micro-batches that trained (on the device: reading them would
    synchronize), how many were skipped, whether the optimizer stepped (not where every micro-batch was skipped; fp16
    may still skip the update for overflow), and the seconds spent waiting for the data."""

    losses: list[torch.Tensor] = field(default_factory=list)
    skipped: int = 0
    stepped: bool = False
    data_wait_s: float = 0.0


def train_step(
    engine: Any,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_fn: Loss,
    guard: StepGuard | None = None,
    where: Callable[[int], str] = lambda index: "this step",
    after_backward: Callable[[torch.Tensor | None], None] | None = None,
    noise: NoiseScale | None = None,
    pieces: int = 1,
    reduction: OverlappedReduction | None = None,
) -> StepResult:
    """One optimizer step: the engine's accumulation count of micro-batches from ``batches``, each in ``pieces`` equal
    parts (a forward and backward each), the optimizer step after the last, the boundary said to DeepSpeed.
    A part the ``guard`` skips (non-finite loss, on every rank alike) adds no gradient: where it is the last, a backward
    of zero keeps the boundary's reduction; where all are skipped, no step is taken. ``after_backward(norm)`` sees the
    step's gradient norm; ``noise`` measures each part's gradient and the step's; ``reduction`` all-reduces the
    gradients during the last backward, waited for before the optimizer step."""
    accumulation = engine.gradient_accumulation_steps()
    if reduction is None and not engine.enable_backward_allreduce and engine.dp_world_size > 1:
        if not engine.zero_optimization():  # the engine's reduction was handed over: without it, ranks drift apart
            raise RuntimeError("the engine's gradient reduction is off: pass its OverlappedReduction to train_step")
    measure = noise is not None or after_backward is not None
    result, norm = StepResult(), None
    for index in range(accumulation):
        waited = time.perf_counter()  # time blocked on the pipeline: what it costs the step
        with phase("data_wait"):
            batch = next(batches, None)
        result.data_wait_s += time.perf_counter() - waited
        if batch is None:
            raise RuntimeError(f"the batches ended {accumulation - index} micro-batch(es) short of a whole step")
        for part, (inputs, targets) in enumerate(zip(*(b.chunk(pieces) for b in batch), strict=True)):
            last = index == accumulation - 1 and part == pieces - 1
            engine.set_gradient_accumulation_boundary(last)
            with phase("forward"):
                loss = loss_fn(engine(inputs), targets)
            if guard is not None and not guard.allows(loss, inputs, targets, where=lambda i=index: where(i)):
                result.skipped += 1
                if not (last and result.losses):
                    continue
                loss = None  # the step's gradients are the earlier parts'
            if reduction is not None:
                reduction.start(boundary=last)
            with phase("backward"):
                if loss is None:
                    backward(engine, _zero_loss(engine))
                else:
                    scale = (loss_scale(engine) or 1.0) / (accumulation * pieces)  # the gradients' factor
                    with noise.micro_batch(scale) if noise is not None else contextlib.nullcontext():
                        backward(engine, loss / pieces if pieces > 1 else loss)  # fp16's loss scale applied once
            if last and reduction is not None:
                with phase("reduce_wait"):
                    reduction.finish()
            if last and measure:
                norm = step_gradient_norm(engine)
                if after_backward is not None:
                    after_backward(norm)
            with phase("optimizer_step"):
                engine.step()  # at the boundary the optimizer step, else a micro-step counted
            if loss is not None:
                result.losses.append(loss.detach())
            result.stepped = last
    if noise is not None:
        applied = result.stepped and not result.skipped and engine.was_step_applied()
        noise.step_done(norm if norm is not None else engine.get_global_grad_norm(), applied=applied)
    return result


def _zero_loss(engine: Any) -> torch.Tensor:
    """A loss of 0 that reaches every trained weight: its backward adds nothing, but runs the boundary's hooks."""
    return torch.stack([(p * 0).sum(dtype=torch.float32) for p in engine.module.parameters() if p.requires_grad]).sum()


class StepGuard:
    """What the ranks agree on: a non-finite loss or batch on any rank (checked at every micro-step where the config
    asks: ``every_step``), and a stop request (SIGTERM, SIGUSR1) on any rank, which travels with every agreement and
    makes ``stopping`` true on every rank alike. Each agreement is one small reduction, so one host sync."""

    def __init__(
        self, faults: Faults, device: torch.device, stop: StopRequest | None, *, nonfinite_losses: int = 0
    ) -> None:
        self.faults, self.device, self.stop = faults, device, stop
        self.every_step = faults.nonfinite_loss != "ignore" or faults.data_checks == "every_batch"
        self.stopping = False
        self.nonfinite_losses, self.nonfinite_in_a_row = nonfinite_losses, 0

    def agree(self, *flags: torch.Tensor) -> list[bool]:
        """``flags`` (0-d tensors, nonzero for true) ORed over the ranks, this rank's stop request with them."""
        requested = float(self.stop is not None and self.stop.requested)
        local = torch.stack([*(f.float() for f in flags), torch.full((), requested, device=self.device)])
        torch_dist.all_reduce(local, op=torch_dist.ReduceOp.MAX)
        *agreed, stop = (bool(v) for v in local.tolist())
        self.stopping = self.stopping or stop
        return agreed

    def allows(
        self, loss: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, *, where: Callable[[], str]
    ) -> bool:
        """Whether the micro-step goes on to its backward, where the config checks every micro-step (else always,
        with no sync): a non-finite batch anywhere stops the run (data_checks: every_batch); a non-finite loss
        anywhere skips the micro-step on every rank, or stops the run (``nonfinite_loss``)."""
        if not self.every_step:
            return True
        bad_batch = torch.zeros((), device=loss.device)
        if self.faults.data_checks == "every_batch":
            bad_batch = ~(torch.isfinite(inputs).all() & torch.isfinite(targets).all())
        nonfinite, bad = self.agree(~torch.isfinite(loss.detach()), bad_batch)
        if bad:
            raise DataError(f"a training batch holds NaN or Inf values ({where()}); data_checks: every_batch")
        if nonfinite and self.faults.nonfinite_loss != "ignore":
            self._nonfinite(where())
            return False
        self.nonfinite_in_a_row = 0
        return True

    def _nonfinite(self, where: str) -> None:
        """A NaN or Inf loss on some rank: every rank skips this micro-batch, or the run stops."""
        self.nonfinite_losses += 1
        self.nonfinite_in_a_row += 1
        if self.faults.nonfinite_loss == "stop":
            raise NumericalError(f"non-finite loss at {where} (nonfinite_loss: stop)")
        if self.nonfinite_in_a_row >= self.faults.max_nonfinite_in_a_row:
            raise NumericalError(
                f"{self.nonfinite_in_a_row} non-finite losses in a row, the last at {where}: stopping "
                f"(max_nonfinite_in_a_row {self.faults.max_nonfinite_in_a_row})"
            )
        log.warning("non-finite loss at %s: batch skipped (%d so far)", where, self.nonfinite_losses)
