"""One training micro-step, the only one: the training loop, the benchmark's timed steps and the GPU tests run it.

Each phase is a named range: ``torch.profiler`` records it (``--profile``), and on a GPU it is also an NVTX range,
so that ``nsys profile`` shows data wait, forward, backward and optimizer step on its timeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from model import unet_loss

# Names of the ranges, in the order a step passes them.
PHASES = ("data_wait", "forward", "backward", "optimizer_step")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A range named ``name`` for torch.profiler and, on a GPU, for NVTX (nsys)."""
    nvtx = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.profiler.record_function(name):
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


def micro_step(
    engine: Any,
    inp: torch.Tensor,
    tar: torch.Tensor,
    lambda_rho: float,
    proceed: Callable[[torch.Tensor], bool] | None = None,
    mark: Callable[[str], None] | None = None,
) -> torch.Tensor | None:
    """Forward, backward and (at an accumulation boundary, where DeepSpeed counts the micro-steps) the optimizer step.

    ``proceed(loss)``, when given, runs between forward and backward and may skip the rest (None is returned: a
    non-finite loss that every rank agreed to skip). ``mark(phase)``, when given, is called as each phase ends
    (the benchmark's timers). Returns the loss still on the device: reading it here would synchronize every step.
    """
    with phase("forward"):
        loss = unet_loss(engine(inp), tar, lambda_rho)
    if proceed is not None and not proceed(loss):
        return None
    if mark is not None:
        mark("forward")
    with phase("backward"):
        engine.backward(loss)
    if mark is not None:
        mark("backward")
    with phase("optimizer_step"):
        engine.step()
    if mark is not None:
        mark("optimizer")
    return loss.detach()
