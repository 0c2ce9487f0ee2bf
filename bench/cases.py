"""The benchmarks' one harness: a case of ``bench.train`` and its command line, a launch in a process group of its
own that a time limit ends whole, rounds that interleave the cases, medians, and the table of precisions."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench.env import REPO
from trainer.config import parse_value
from trainer.engine import load_ds_template, merge_settings


@dataclass(frozen=True, kw_only=True)
class Precision:
    json: str
    """The project's DeepSpeed JSON of this precision."""
    overrides: dict[str, Any]
    """The same as overrides of any DeepSpeed JSON, which keep its optimizer and ZeRO settings."""


def _precisions() -> dict[str, Precision]:
    fp16_json = "ds_configs/ds_fp16.json"
    fp16 = load_ds_template(REPO / fp16_json)["fp16"]  # its loss-scaling settings
    return {
        "fp32": Precision(
            json="ds_configs/ds_fp32.json", overrides={"fp16": {"enabled": False}, "bf16": {"enabled": False}}
        ),
        "bf16": Precision(
            json="ds_configs/ds_bf16.json", overrides={"fp16": {"enabled": False}, "bf16": {"enabled": True}}
        ),
        "fp16": Precision(json=fp16_json, overrides={"fp16": fp16, "bf16": {"enabled": False}}),
    }


PRECISIONS = _precisions()


def bf16_supported(device_type: str) -> bool:
    """Whether DeepSpeed trains in bf16 on this machine's ``device_type``."""
    import torch

    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_bf16_supported())


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """What a sweep's records are for, which ``bench.report`` draws and ``bench.sweep`` schedules by: throughput against
    ranks (``scaling``), the step's phases and the engine against the plain loop (``phases``), throughput against
    the micro-batch (``micro_batch``); cases run interleaved and repeated, for comparisons at the noise's level
    (``repeated``)."""

    scaling: bool = False
    phases: bool = False
    micro_batch: bool = False
    repeated: bool = False


SWEEPS: dict[str, Sweep] = {
    "baseline": Sweep(phases=True),
    "precision": Sweep(phases=True),
    "headline": Sweep(phases=True),
    "speed": Sweep(phases=True),
    "micro-batch": Sweep(micro_batch=True),
    "weak": Sweep(scaling=True, repeated=True),
    "strong": Sweep(scaling=True, repeated=True),
    **{f"weak-zero{stage}": Sweep(scaling=True, repeated=True) for stage in (0, 1, 2)},
    **{f"weak-overlapped{mb}": Sweep(scaling=True, repeated=True) for mb in (25, 100)},
    "zero2-settings": Sweep(repeated=True),
}


def sweep_of(name: str) -> Sweep:
    """The sweep of that name (a case run on its own, ``adhoc``, is none of the kinds)."""
    return SWEEPS.get(name, Sweep())


@dataclass(frozen=True, kw_only=True)
class TrainCase:
    """One run of ``python -m bench.train``: its sweep, its label there, its ranks, modes and own options."""

    sweep: str
    label: str
    ranks: int = 1
    modes: Sequence[str] = ("full",)
    options: list[str] = field(default_factory=list)
    repeat: int = 0

    def launcher(self, *, launcher: str = "deepspeed", ranks_per_node: int = 1) -> list[str]:
        """What starts its ranks: the interpreter alone for one rank, else DeepSpeed's launcher or srun."""
        if self.ranks == 1 and launcher != "srun":
            return [sys.executable, "-m", "bench.train"]
        if launcher == "srun":
            nodes = -(-self.ranks // ranks_per_node)
            srun = ["srun", "--kill-on-bad-exit=1", f"--ntasks={self.ranks}", f"--nodes={nodes}"]
            return [*srun, sys.executable, "-m", "bench.train"]
        runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(self.ranks)]
        return [*runner, "--module", "bench.train"]

    def train_options(
        self, base: list[str], *, steps: int, warmup: int, run_id: str, out: str, extra: Sequence[str] = ()
    ) -> list[str]:
        """bench.train's options: ``base`` (the config), then the case's own, then ``extra`` (the user's), later
        ones winning, --deepspeed_overrides merged key by key."""
        harness = ["--modes", *self.modes, "--steps", str(steps), "--warmup", str(warmup), "--sweep", self.sweep]
        harness += ["--case", self.label, "--run_id", run_id, "--repeat", str(self.repeat), "--out", out]
        return merge_overrides([*base, *harness, *self.options, *extra])


def merge_overrides(options: list[str]) -> list[str]:
    """``options`` with their --deepspeed_overrides merged into one, the later ones winning key by key: a case's
    own settings (a ZeRO bucket size) and the user's (the optimizer, say) both hold."""
    rest, merged, found = [], {}, False
    options_ = iter(options)
    for option in options_:
        if option != "--deepspeed_overrides":
            rest.append(option)
            continue
        value, found = parse_value(next(options_, "")), True
        if not isinstance(value, dict):
            sys.exit(f"--deepspeed_overrides must be a mapping, got {value!r}")
        merged = merge_settings(merged, value)
    return rest + (["--deepspeed_overrides", json.dumps(merged)] if found else [])


@dataclass(frozen=True, kw_only=True)
class Launched:
    """How a launched command ended: its exit status, whether its time limit stopped it, its output and wall time."""

    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    wall_s: float

    @property
    def output(self) -> str:
        return self.stderr + self.stdout


def launch(
    command: list[str],
    *,
    timeout_s: float | None = None,
    capture: bool = True,
    stop: int = signal.SIGKILL,
    watch: Callable[[int], None] | None = None,
) -> Launched:
    """Run ``command`` from the repository in a process group of its own (a launcher's ranks are in it too), its
    output captured or not; ``watch(pid)`` is called every 0.1 s while it runs. Past ``timeout_s`` the group gets
    ``stop`` (SIGKILL, or SIGTERM for a run that saves and ends) and is waited for. Interrupted here, the group is
    killed: no rank outlives its harness."""
    pipe = subprocess.PIPE if capture else None
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    timed_out = False
    try:
        while True:
            left = None if timeout_s is None else start + timeout_s - time.monotonic()
            wait = left if watch is None else (0.1 if left is None else min(0.1, max(left, 0.0)))
            try:
                stdout, stderr = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:  # the output read so far is kept for the next call
                if timeout_s is not None and time.monotonic() >= start + timeout_s:
                    timed_out = True
                    os.killpg(proc.pid, stop)
                    stdout, stderr = proc.communicate()
                    break
                if watch is not None:
                    watch(proc.pid)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return Launched(
        returncode=proc.returncode,
        timed_out=timed_out,
        stdout=stdout or "",
        stderr=stderr or "",
        wall_s=time.monotonic() - start,
    )


T = TypeVar("T")


def rounds(cases: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """(round, case) for ``repeats`` rounds over ``cases`` in turn (a, b, c, a, b, c...), so that drift on a shared
    machine falls on every case alike; report each case's median."""
    for round_ in range(repeats):
        for case in cases:
            yield round_, case


def rate_summary(rates: list[float]) -> dict[str, float]:
    """The median of a case's rates over its rounds, with their spread."""
    return {"samples_per_s": statistics.median(rates), "samples_per_s_min": min(rates), "samples_per_s_max": max(rates)}
