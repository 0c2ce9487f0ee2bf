"""Sweeps of bench.train cases through the launcher, then the report.

    python -m bench.sweep --preset cpu-smoke          # this machine: 1 and 2 ranks, small model, a few minutes
    python -m bench.sweep --preset gpu --max_ranks 8  # a GPU node or allocation (see slurm/bench.sbatch)
    python -m bench.sweep --preset gpu-speed --backend torch   # options it does not know go to every case
    # (a --deepspeed_overrides merges with a case's own, key by key)

Every case is its own process (its own ranks), launched by DeepSpeed's launcher on one node or by
srun inside a Slurm allocation (``--launcher srun``); every record carries the sweep's run id.
Sweeps: the baseline (IO, SYNTHETIC, FULL, and the plain loop), micro-batch, precision, weak scaling
(micro-batch per rank fixed) and strong scaling (global batch fixed); on GPUs also the fast paths off
and on (``--preset gpu-speed``) and ZeRO stages 0/1/2 under weak scaling (``--preset gpu-comm``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from bench.env import REPO
from bench.train import RESULTS, parse_args
from common.cli import ArgumentParser, output_file
from pipeline.loaders import dali_installed, resolve_backend
from pipeline.synthetic import ensure_boxes
from trainer.build import engine_config
from trainer.config import Config, parse_value
from trainer.engine import merge_settings, plan_batches
from trainer.errors import ConfigError
from trainer.fused_adam import TORCH_FUSED_ADAM

PRECISION_JSON = {
    "fp32": "ds_configs/ds_fp32.json",
    "bf16": "ds_configs/ds_bf16.json",
    "fp16": "ds_configs/ds_fp16.json",
}


@dataclass(kw_only=True)
class SweepRun:
    sweep: str
    label: str
    ranks: int
    modes: list[str]
    options: list[str] = field(default_factory=list)
    repeat: int = 0


def interleave_repeats(cases: list[SweepRun], sweeps: tuple[str, ...], repeats: int) -> list[SweepRun]:
    """Repeat the cases of ``sweeps``, round after round (1, 2, 1, 2 ranks...), so that drift on a shared
    machine falls on every case alike; the report takes the median per case."""
    once = [c for c in cases if c.sweep not in sweeps]
    repeated = [c for c in cases if c.sweep in sweeps]
    rounds = [
        SweepRun(sweep=c.sweep, label=c.label, ranks=c.ranks, modes=c.modes, options=c.options, repeat=r)
        for r in range(repeats)
        for c in repeated
    ]
    return once + rounds


def _batch(micro: int, ranks: int) -> list[str]:
    return ["--global_batch_size", str(micro * ranks), "--base_batch_size", str(micro * ranks)]


def cpu_smoke(max_ranks: int) -> tuple[list[str], list[SweepRun]]:
    """The debug model on this machine's cores; scaling runs with one thread per rank."""
    base = ["--config", "debug", "--deepspeed_config", PRECISION_JSON["fp32"]]
    one_thread = ["--cpu_threads", "1", "--num_data_workers", "1"]
    rounds = ["--rounds", "3"]  # the engine and the plain loop in turn: the ratio sees no drift between them
    cases = [
        SweepRun(
            sweep="baseline",
            label="micro 8",
            ranks=1,
            modes=["io", "synthetic", "full", "plain"],
            options=_batch(8, 1) + rounds,
        )
    ]
    cases += [
        SweepRun(sweep="micro-batch", label=f"micro {m}", ranks=1, modes=["synthetic"], options=_batch(m, 1))
        for m in (2, 4, 8, 16)
    ]
    cases += [
        SweepRun(
            sweep="precision",
            label="bf16",
            ranks=1,
            modes=["synthetic", "plain"],
            options=_batch(8, 1) + rounds + ["--deepspeed_config", PRECISION_JSON["bf16"]],
        )
    ]
    # Scaling at micro-batch 16, where one rank's throughput saturates (the micro-batch sweep); the
    # gradient all-reduce per step is fixed, so smaller batches scale worse (micro 8 measured 0.74-0.82).
    ranks = [n for n in (1, 2, 4, 8) if n <= max_ranks]
    # The plain loop runs too: DDP overlaps its all-reduce with backward, ZeRO stage 0 does not.
    cases += [
        SweepRun(
            sweep="weak",
            label=f"{n} rank(s), micro 16",
            ranks=n,
            modes=["synthetic", "plain"],
            options=_batch(16, n) + one_thread,
        )
        for n in ranks
    ]
    cases += [
        SweepRun(
            sweep="strong",
            label=f"{n} rank(s), global 32",
            ranks=n,
            modes=["synthetic"],
            options=["--global_batch_size", "32", "--base_batch_size", "32"] + one_thread,
        )
        for n in ranks
    ]
    return base, cases


def gpu(max_ranks: int) -> tuple[list[str], list[SweepRun]]:
    """The reference model at 64^3 on GPUs: batch 64 per GPU, fp16 unless the case says otherwise."""
    base = [
        "--config",
        "bs64_opt",
        "--synthetic",
        "{train_box_size: 256, val_box_size: 128, seed: 0}",
        "--train_path",
        "data/bench/gpu_train.h5",
        "--val_path",
        "data/bench/gpu_val.h5",
        "--storage",
        "device",
        "--Nsamples",
        "65536",
        "--Nsamples_val",
        "256",
    ]
    cases = [
        SweepRun(
            sweep="baseline",
            label="micro 64",
            ranks=1,
            modes=["io", "synthetic", "full", "plain"],
            options=_batch(64, 1) + ["--rounds", "3"],
        )
    ]
    cases += [
        SweepRun(sweep="micro-batch", label=f"micro {m}", ranks=1, modes=["synthetic"], options=_batch(m, 1))
        for m in (16, 32, 64, 128)
    ]
    cases += [
        SweepRun(
            sweep="precision",
            label=p,
            ranks=1,
            modes=["synthetic", "plain"],
            options=_batch(64, 1) + ["--rounds", "3", "--deepspeed_config", PRECISION_JSON[p]],
        )
        for p in ("fp32", "bf16")
    ]
    ranks = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_ranks]
    cases += [
        SweepRun(
            sweep="weak",
            label=f"{n} rank(s), micro 64",
            ranks=n,
            modes=["synthetic", "full", "plain"],
            options=_batch(64, n),
        )
        for n in ranks
    ]
    cases += [
        SweepRun(
            sweep="strong",
            label=f"{n} rank(s), global 512",
            ranks=n,
            modes=["synthetic"],
            options=["--global_batch_size", "512", "--base_batch_size", "512"],
        )
        for n in ranks
        if 512 % n == 0
    ]
    return base, cases


# Fast paths, off (the plain path) and on one at a time, then all together.
FAST_PATHS = {
    "channels_last": ["--channels_last", "true"],
    "cudnn_benchmark": ["--cudnn_benchmark", "true"],
    "compile": ["--compile", "true"],
    "no step sync": ["--nonfinite_loss", "ignore"],
    "pad last layer": ["--pad_last_layer", "true"],
}
PLAIN_PATH = [
    "--channels_last",
    "false",
    "--cudnn_benchmark",
    "false",
    "--compile",
    "false",
    "--nonfinite_loss",
    "skip",
    "--pad_last_layer",
    "false",
]
# Tried last, on fp16 only, and joined to "all fast paths" only once measured to help: compile with CUDA graphs;
# cuDNN timing every algorithm it has (not torch's first 10), against "+ cudnn_benchmark"; torch's fused Adam in
# place of DeepSpeed's FusedAdam (no JIT build; DeepSpeed's unfused fp16 wrapper around it).
TRIED_LAST = {
    "+ compile, CUDA graphs": ["--compile", "true", "--compile_mode", "reduce-overhead"],
    "+ cudnn_benchmark, every algorithm": ["--cudnn_benchmark", "true", "--cudnn_benchmark_limit", "0"],
    "torch fused Adam": ["--deepspeed_overrides", json.dumps({"optimizer": {"params": TORCH_FUSED_ADAM}})],
}


# The headline: fp16 with DeepSpeed's FusedAdam (where it builds) and the convolution settings that measured fastest
# on an H200 so far, against the plain torch loop on the same settings.
HEADLINE = ["--channels_last", "true", "--cudnn_benchmark", "true"]


def gpu_speed(max_ranks: int) -> tuple[list[str], list[SweepRun]]:
    """One GPU, the reference model at 64^3, batch 64: the headline (sweep "headline"), then fp16 and bf16 with each
    fast path off and on (sweep "speed")."""
    base, _ = gpu(max_ranks)
    every = [option for switch in FAST_PATHS.values() for option in switch]

    def case(
        precision: str, what: str, switches: list[str], *, sweep: str = "speed", modes=("synthetic", "full")
    ) -> SweepRun:
        common = _batch(64, 1) + ["--deepspeed_config", PRECISION_JSON[precision], "--warmup", "10"] + PLAIN_PATH
        return SweepRun(sweep=sweep, label=f"{precision} {what}", ranks=1, modes=list(modes), options=common + switches)

    headline = [
        case(
            "fp16",
            "channels_last + cudnn.benchmark",
            HEADLINE + ["--rounds", "2"],
            sweep="headline",
            modes=("synthetic", "full", "plain"),
        )
    ]
    paths = [
        case(p, what, switches)
        for what, switches in (("plain path", []), ("all fast paths", every))
        for p in ("fp16", "bf16")
    ]
    single = [case(p, f"+ {name}", switch) for p in ("fp16", "bf16") for name, switch in FAST_PATHS.items()]
    # The headline first, then the plain path of both precisions before the compiled ones: a run cut short (a
    # time-limited allocation) still has them.
    return base, headline + paths + single + [case("fp16", what, switches) for what, switches in TRIED_LAST.items()]


# ZeRO 2's communication settings, compared at the most ranks (merged into ds_fp16_zero2.json).
ZERO2_SETTINGS = {
    "bucket 2e8": {"zero_optimization": {"reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000}},
    "bucket 5e8": {"zero_optimization": {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000}},
    "no overlap": {"zero_optimization": {"overlap_comm": False}},
}


def gpu_comm(max_ranks: int) -> tuple[list[str], list[SweepRun]]:
    """Weak scaling with ZeRO stage 0 (all-reduce after backward), 1 and 2 (overlapped reduction); then, at the
    most ranks, ZeRO 2's bucket sizes and overlap against ds_fp16_zero2.json's own (5e7, overlapped)."""
    base, _ = gpu(max_ranks)
    ranks = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_ranks]
    configs = {0: "ds_configs/ds_fp16.json", 1: "ds_configs/ds_fp16_zero1.json", 2: "ds_configs/ds_fp16_zero2.json"}
    cases = [
        SweepRun(
            sweep=f"weak-zero{stage}",
            label=f"{n} rank(s), micro 64, ZeRO {stage}",
            ranks=n,
            modes=["synthetic"],
            options=_batch(64, n) + ["--deepspeed_config", json_path],
        )
        for stage, json_path in configs.items()
        for n in ranks
    ]
    n = ranks[-1]
    if n > 1:
        zero2 = _batch(64, n) + ["--deepspeed_config", configs[2], "--deepspeed_overrides"]
        cases += [
            SweepRun(
                sweep="zero2-settings",
                label=f"{n} rank(s), micro 64, ZeRO 2, {name}",
                ranks=n,
                modes=["synthetic"],
                options=zero2 + [json.dumps(override)],
            )
            for name, override in ZERO2_SETTINGS.items()
        ]
    return base, cases


PRESETS = {"cpu-smoke": cpu_smoke, "gpu": gpu, "gpu-speed": gpu_speed, "gpu-comm": gpu_comm}


def command(case: SweepRun, launcher: str, ranks_per_node: int) -> list[str]:
    if case.ranks == 1 and launcher != "srun":
        return [sys.executable, "-m", "bench.train"]
    if launcher == "srun":
        nodes = -(-case.ranks // ranks_per_node)
        return [
            "srun",
            "--kill-on-bad-exit=1",
            f"--ntasks={case.ranks}",
            f"--nodes={nodes}",
            sys.executable,
            "-m",
            "bench.train",
        ]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(case.ranks), "--module", "bench.train"]


def merge_overrides(options: list[str]) -> list[str]:
    """``options`` with their --deepspeed_overrides merged into one, the later ones winning key by key: a case's
    own settings (a ZeRO bucket size) and the user's (the optimizer, say) both hold."""
    rest, merged, found = [], {}, False
    options = iter(options)
    for option in options:
        if option != "--deepspeed_overrides":
            rest.append(option)
            continue
        value, found = parse_value(next(options, "")), True
        if not isinstance(value, dict):
            sys.exit(f"--deepspeed_overrides must be a mapping, got {value!r}")
        merged = merge_settings(merged, value)
    return rest + (["--deepspeed_overrides", json.dumps(merged)] if found else [])


def train_options(base: list[str], case: SweepRun, args: argparse.Namespace, *, run_id: str) -> list[str]:
    """The options of ``python -m bench.train`` for one case of a sweep."""
    # The case's own options override the sweep's (more warm-up to compile, say); the user's override both.
    return merge_overrides(
        [
            *base,
            "--modes",
            *case.modes,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--sweep",
            case.sweep,
            "--case",
            case.label,
            "--run_id",
            run_id,
            "--repeat",
            str(case.repeat),
            "--out",
            str(args.out),
            *case.options,
            *args.train_options,
        ]
    )


def check_cases(base: list[str], cases: list[SweepRun], args: argparse.Namespace, *, device_type: str) -> list[tuple]:
    """Every case makes a valid run on ``device_type`` (its options, its batches over its ranks, its DeepSpeed
    JSON, DALI where its crops need it), checked before the first one starts, so that a typo costs seconds, not an
    allocation.

    Returns (bench.train's options, config, resolved DeepSpeed config) per case; exits on the first bad one.
    """
    from deepspeed.runtime.config import DeepSpeedConfig  # imported here, after trainer has named the accelerator

    checked = []
    for case in cases:
        try:
            options, cfg = parse_args(train_options(base, case, args, run_id="check"))
            plan = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, case.ranks)
            ds_config = engine_config(cfg, case.ranks, device_type)  # the run's own, peak learning rate included
        except ConfigError as err:
            sys.exit(f"case {case.label!r}: {err}")
        try:  # DeepSpeed's own checks (unknown keys, wrong types), with the batch as one rank sees it here
            DeepSpeedConfig({**ds_config, "train_batch_size": plan.micro_batch * plan.accumulation})
        except (ValueError, TypeError, AssertionError) as err:
            sys.exit(f"case {case.label!r}: DeepSpeed rejects its config: {' '.join(str(err).split())}")
        if resolve_backend(cfg.backend, device_type, cfg.storage) == "dali" and not dali_installed():
            sys.exit(f"case {case.label!r}: backend dali, but NVIDIA DALI is not installed here: add --backend torch")
        checked.append((options, cfg, ds_config))
    return checked


def write_synthetic_data(configs: list[Config]) -> None:
    """The cases' synthetic boxes, written once before the first case, so that no case's run pays for them."""
    for cfg in configs:
        if cfg.synthetic is not None:
            for which, path in ensure_boxes(cfg.synthetic, cfg.train_path, cfg.val_path):
                print(f"wrote the synthetic {which} box {path}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smoke")
    parser.add_argument(
        "--max_ranks", type=int, default=2 if not torch.cuda.is_available() else torch.cuda.device_count()
    )
    parser.add_argument("--launcher", choices=["deepspeed", "srun"], default="deepspeed")
    parser.add_argument("--ranks_per_node", type=int, default=max(1, torch.cuda.device_count()))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--only",
        nargs="*",
        help="run only these sweeps (the records' sweep names: baseline, speed, weak, weak-zero2, zero2-settings...)",
    )
    parser.add_argument("--scaling_repeats", type=int, default=3, help="runs of each scaling case; the median counts")
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    parser.add_argument("--no_report", action="store_true")
    parser.add_argument(
        "--run_id", help="the records' run id (default: the start time); runs that share one are reported together"
    )
    args, rest = parser.parse_known_args(argv)
    args.train_options = rest  # options of bench.train for every case (--backend torch, say)
    base, cases = PRESETS[args.preset](args.max_ranks)
    if args.preset.startswith("gpu") and not torch.cuda.is_available():
        parser.error(f"the {args.preset} preset needs a GPU")
    if not torch.cuda.is_available() and any(c.label == "bf16" for c in cases):
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_bf16_supported():
            cases = [c for c in cases if c.label != "bf16"]
    compared = tuple(sorted({c.sweep for c in cases if c.sweep.startswith(("weak", "strong", "zero2-settings"))}))
    cases = interleave_repeats(cases, compared, args.scaling_repeats)
    cases = [c for c in cases if not args.only or c.sweep in args.only]
    checked = check_cases(base, cases, args, device_type="cuda" if torch.cuda.is_available() else "cpu")
    write_synthetic_data([cfg for _, cfg, _ in checked])
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S")
    failures = []
    for case in cases:
        cmd = [*command(case, args.launcher, args.ranks_per_node), *train_options(base, case, args, run_id=run_id)]
        print(f"[{case.sweep}] {case.label} (run {case.repeat + 1}): {' '.join(case.modes)}", flush=True)
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            failures.append(case.label)
            print(result.stderr[-3000:], file=sys.stderr)
    if not args.no_report:
        from bench.report import main as report

        report(["--results", str(args.out)])
    if failures:
        sys.exit(f"failed cases: {', '.join(failures)}")


if __name__ == "__main__":
    main()
