"""Where the time of profiled steps goes: ranges named after the U-Net's blocks, forward and backward, and a table of
the most expensive kernels and of each block's share, written beside ``--profile``'s trace.

The blocks' ranges come from module hooks that exist only while profiling. Their time is the device's where there
is one (the kernels launched inside each range), else the CPU's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from model import UNet

log = logging.getLogger(__name__)
TOP_KERNELS = 10
PROFILE_STEPS = 3  # optimizer steps a trace records, after one skipped and one of warm-up


def blocks(model: UNet) -> list[tuple[str, torch.nn.Module]]:
    """The blocks a step passes, by name: down.0 ... the bottom, up.0 ..., and the last layer (where it is called
    as a module, not padded: ``UNet.pad_last_layer``)."""
    named = [(f"down.{i}", m) for i, m in enumerate(model.down)] + [(f"up.{i}", m) for i, m in enumerate(model.up)]
    if model.last_padded_to == model.last.out_channels:
        named.append(("last", model.last))
    return named


@contextmanager
def block_ranges(model: UNet) -> Iterator[None]:
    """A ``torch.profiler`` range around each block's forward ("forward down.0") and backward ("backward down.0")."""
    open_ranges: dict[str, Any] = {}

    def enter(name: str, *_: Any) -> None:
        open_ranges[name] = torch.profiler.record_function(name)
        open_ranges[name].__enter__()

    def leave(name: str, *_: Any) -> None:
        if name in open_ranges:
            open_ranges.pop(name).__exit__(None, None, None)

    # A block's backward ends when the last of its parameters has its gradient (a module's own backward hook fires
    # at once where its inputs need none, as the first block's do).
    waiting: dict[str, int] = {}

    def backward_begins(name: str, count: int, *_: Any) -> None:
        waiting[name] = count
        enter(name)

    def gradient_done(name: str, *_: Any) -> None:
        waiting[name] -= 1
        if waiting[name] == 0:
            leave(name)

    handles = []
    for name, block in blocks(model):
        params = [p for p in block.parameters() if p.requires_grad]
        handles += [
            block.register_forward_pre_hook(functools.partial(enter, f"forward {name}")),
            block.register_forward_hook(functools.partial(leave, f"forward {name}")),
            block.register_full_backward_pre_hook(functools.partial(backward_begins, f"backward {name}", len(params))),
        ]
        handles += [
            p.register_post_accumulate_grad_hook(functools.partial(gradient_done, f"backward {name}")) for p in params
        ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for name in list(open_ranges):
            leave(name)


def summary(prof: torch.profiler.profile, *, on_gpu: bool) -> str:
    """The profiled steps' most expensive kernels (CPU ops without a GPU) by their own time, and each block's time
    forward and backward, as shares of the steps' total."""
    events = prof.key_averages()
    own = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    spanned = "device_time_total" if on_gpu else "cpu_time_total"
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    if on_gpu:  # kernels, not the GPU-side copies of the ranges (user annotations), which span whole phases
        kernels = [e for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]
    else:
        kernels = [e for e in events if e.key.startswith("aten::")]
    total_us = sum(getattr(e, own) for e in kernels) or 1.0
    where = "GPU kernels" if on_gpu else "CPU operators"
    lines = [f"{where}: {total_us / 1e3:.1f} ms over the profiled steps", "", f"the {TOP_KERNELS} most expensive:"]
    for e in sorted(kernels, key=lambda e: -getattr(e, own))[:TOP_KERNELS]:
        time_us = getattr(e, own)
        lines.append(f"{time_us / 1e3:9.2f} ms {time_us / total_us:6.1%}  {e.count:5d} x  {e.key[:110]}")
    # each range once: its CPU-side event, whose device time is that of the kernels launched inside it
    ranges = {
        e.key: getattr(e, spanned)
        for e in events
        if e.device_type == cpu and e.key.startswith(("forward ", "backward "))
    }
    names = sorted({key.split(" ", 1)[1] for key in ranges}, key=_block_order)
    lines += ["", "per block:         forward            backward"]
    for name in names:
        fwd, bwd = ranges.get(f"forward {name}", 0.0), ranges.get(f"backward {name}", 0.0)
        lines.append(f"{name:8s} {fwd / 1e3:9.2f} ms {fwd / total_us:6.1%} {bwd / 1e3:9.2f} ms {bwd / total_us:6.1%}")
    inside = sum(ranges.values())
    lines.append(f"outside the blocks (loss, optimizer, data, other): {max(0.0, 1 - inside / total_us):.1%}")
    return "\n".join(lines) + "\n"


def _block_order(name: str) -> tuple[int, int]:
    part, _, index = name.partition(".")
    return ({"down": 0, "up": 1}.get(part, 2), int(index or 0))


def write_summary(prof: torch.profiler.profile, path: Path, *, on_gpu: bool) -> None:
    path.write_text(summary(prof, on_gpu=on_gpu))


class StepProfiler:
    """``--profile``: a torch.profiler trace of optimizer steps 3 to 5 (the first two skipped as warm-up) into
    ``out_dir``, one file per rank, which TensorBoard's profiler plugin or Perfetto reads, with the blocks' ranges
    (unless the model is compiled: hooks added after compiling would break or escape its graphs) and the summary
    table beside it. ``step()`` after each optimizer step; ``stop()`` at the end (or on an error)."""

    def __init__(self, model: UNet, out_dir: Path, rank: int, *, on_gpu: bool, compiled: bool) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.out_dir, self.rank = out_dir, rank
        trace = torch.profiler.tensorboard_trace_handler(str(out_dir), worker_name=f"rank{rank}")
        table = out_dir / f"summary_rank{rank}.txt"

        def ready(prof: torch.profiler.profile) -> None:
            self._stop_block_ranges()  # the steps after the recorded ones run without the hooks
            trace(prof)
            write_summary(prof, table, on_gpu=on_gpu)
            log.info("profile of steps 3 to %d: %s", 2 + PROFILE_STEPS, table)

        schedule = torch.profiler.schedule(wait=1, warmup=1, active=PROFILE_STEPS, repeat=1)
        self.profiler: torch.profiler.profile | None = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=ready
        )
        self.block_ranges: contextlib.AbstractContextManager | None = None
        if compiled:
            log.warning("--profile with compile: true: no per-block ranges, the kernels only")
        else:
            self.block_ranges = block_ranges(model)
            self.block_ranges.__enter__()
        self.profiler.start()
        log.info("profiling steps 3 to %d into %s", 2 + PROFILE_STEPS, out_dir)

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        """End the trace (once); says so where the run ended before the recorded steps began."""
        if self.profiler is None:
            return
        self.profiler.stop()
        self.profiler = None
        self._stop_block_ranges()
        if not any(self.out_dir.glob(f"rank{self.rank}*")):
            log.warning("--profile: the run ended before the recorded steps began: no trace was written")

    def _stop_block_ranges(self) -> None:
        if self.block_ranges is not None:
            self.block_ranges.__exit__(None, None, None)
            self.block_ranges = None
