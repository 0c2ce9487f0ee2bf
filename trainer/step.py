"""One training micro-step, the only one: the training loop, the benchmark's timed steps and the GPU tests run it;
and ``StepGuard``, through which the ranks agree between steps on what to do next.

Each phase is a named range: ``torch.profiler`` records it (``--profile``), and on a GPU it is also an NVTX range,
so that ``nsys profile`` shows data wait, forward, backward and optimizer step on its timeline.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist

from model import Loss
from pipeline.volumes import DataError
from trainer.config import Config
from trainer.errors import NumericalError
from trainer.loss_scaling import backward
from trainer.preemption import StopRequest

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


def micro_step(
    engine: Any,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    loss_fn: Loss,
    guard: StepGuard | None = None,
    where: Callable[[], str] = lambda: "this step",
    after_backward: Callable[[], None] | None = None,
) -> torch.Tensor | None:
    """Forward, backward and (at an accumulation boundary, where DeepSpeed counts the micro-steps) the optimizer step.

    The ``guard`` may skip the rest after the forward (None is returned: a non-finite loss every rank agreed to skip);
    ``after_backward()`` sees the gradients before the optimizer takes them. Returns the loss still on the device:
    reading it here would synchronize every step.
    """
    with phase("forward"):
        loss = loss_fn(engine(inputs), targets)
    if guard is not None and not guard.allows(loss, inputs, targets, where=where):
        return None
    with phase("backward"):
        backward(engine, loss)  # engine.backward, with fp16's loss scale applied exactly once
    if after_backward is not None:
        after_backward()
    with phase("optimizer_step"):
        engine.step()
    return loss.detach()


class StepGuard:
    """What the ranks agree on: a non-finite loss or batch on any rank (checked at every micro-step where the config
    asks: ``every_step``), and a stop request (SIGTERM, SIGUSR1) on any rank, which travels with every agreement and
    makes ``stopping`` true on every rank alike. Each agreement is one small reduction, so one host sync."""

    def __init__(
        self, cfg: Config, device: torch.device, stop: StopRequest | None, *, nonfinite_losses: int = 0
    ) -> None:
        self.cfg, self.device, self.stop = cfg, device, stop
        self.every_step = cfg.nonfinite_loss != "ignore" or cfg.data_checks == "every_batch"
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
        if self.cfg.data_checks == "every_batch":
            bad_batch = ~(torch.isfinite(inputs).all() & torch.isfinite(targets).all())
        nonfinite, bad = self.agree(~torch.isfinite(loss.detach()), bad_batch)
        if bad:
            raise DataError(f"a training batch holds NaN or Inf values ({where()}); data_checks: every_batch")
        if nonfinite and self.cfg.nonfinite_loss != "ignore":
            self._nonfinite(where())
            return False
        self.nonfinite_in_a_row = 0
        return True

    def _nonfinite(self, where: str) -> None:
        """A NaN or Inf loss on some rank: every rank skips this micro-batch, or the run stops."""
        self.nonfinite_losses += 1
        self.nonfinite_in_a_row += 1
        if self.cfg.nonfinite_loss == "stop":
            raise NumericalError(f"non-finite loss at {where} (nonfinite_loss: stop)")
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_in_a_row:
            raise NumericalError(
                f"{self.nonfinite_in_a_row} non-finite losses in a row, the last at {where}: stopping "
                f"(max_nonfinite_in_a_row {self.cfg.max_nonfinite_in_a_row})"
            )
        log.warning("non-finite loss at %s: batch skipped (%d so far)", where, self.nonfinite_losses)
