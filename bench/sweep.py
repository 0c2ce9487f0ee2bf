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
import sys
import time
from dataclasses import replace

import torch

from bench.cases import PRECISIONS, TrainCase, bf16_supported, launch, rounds, sweep_of
from bench.train import RESULTS, parse_args
from common.cli import ArgumentParser, output_file
from pipeline.loaders import dali_installed, resolve_backend
from pipeline.storage import planned
from pipeline.synthetic import ensure_boxes
from trainer.config import Config
from trainer.engine import engine_config, plan_batches
from trainer.errors import ConfigError
from trainer.fused_adam import TORCH_FUSED_ADAM


def interleave_repeats(cases: list[TrainCase], sweeps: tuple[str, ...], repeats: int) -> list[TrainCase]:
    """Repeat the cases of ``sweeps`` in rounds (1, 2, 1, 2 ranks...); the report takes the median per case."""
    once = [c for c in cases if c.sweep not in sweeps]
    return once + [replace(c, repeat=r) for r, c in rounds([c for c in cases if c.sweep in sweeps], repeats)]


def _overlapped(bucket_mb: int) -> list[str]:
    return ["--gradient_reduction", "overlapped", "--reduce_bucket_mb", str(bucket_mb)]


def _batch(micro: int, ranks: int) -> list[str]:
    return ["--global_batch_size", str(micro * ranks), "--base_batch_size", str(micro * ranks)]


def cpu_smoke(max_ranks: int) -> tuple[list[str], list[TrainCase]]:
    """The debug model on this machine's cores; scaling runs with one thread per rank."""
    base = ["--config", "debug", "--deepspeed_config", PRECISIONS["fp32"].json]
    one_thread = ["--cpu_threads", "1", "--num_data_workers", "1"]
    rounds = ["--rounds", "3"]  # the engine and the plain loop in turn: the ratio sees no drift between them
    cases = [
        TrainCase(
            sweep="baseline",
            label="micro 8",
            ranks=1,
            modes=["io", "synthetic", "full", "plain"],
            options=_batch(8, 1) + rounds,
        )
    ]
    cases += [
        TrainCase(sweep="micro-batch", label=f"micro {m}", ranks=1, modes=["synthetic"], options=_batch(m, 1))
        for m in (2, 4, 8, 16)
    ]
    cases += [
        TrainCase(
            sweep="precision",
            label="bf16",
            ranks=1,
            modes=["synthetic", "plain"],
            options=_batch(8, 1) + rounds + ["--deepspeed_config", PRECISIONS["bf16"].json],
        )
    ]
    # Scaling at micro-batch 16, where one rank's throughput saturates (the micro-batch sweep); the
    # gradient all-reduce per step is fixed, so smaller batches scale worse (micro 8 measured 0.74-0.82).
    ranks = [n for n in (1, 2, 4, 8) if n <= max_ranks]
    # The plain loop runs too: DDP overlaps its all-reduce with backward, ZeRO stage 0 does not.
    cases += [
        TrainCase(
            sweep="weak",
            label=f"{n} rank(s), micro 16",
            ranks=n,
            modes=["synthetic", "plain"],
            options=_batch(16, n) + one_thread,
        )
        for n in ranks
    ]
    cases += [
        TrainCase(
            sweep="strong",
            label=f"{n} rank(s), global 32",
            ranks=n,
            modes=["synthetic"],
            options=["--global_batch_size", "32", "--base_batch_size", "32"] + one_thread,
        )
        for n in ranks
    ]
    return base, cases


def gpu(max_ranks: int) -> tuple[list[str], list[TrainCase]]:
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
        TrainCase(
            sweep="baseline",
            label="micro 64",
            ranks=1,
            modes=["io", "synthetic", "full", "plain"],
            options=_batch(64, 1) + ["--rounds", "3"],
        )
    ]
    cases += [
        TrainCase(sweep="micro-batch", label=f"micro {m}", ranks=1, modes=["synthetic"], options=_batch(m, 1))
        for m in (16, 32, 64, 128)
    ]
    cases += [
        TrainCase(
            sweep="precision",
            label=p,
            ranks=1,
            modes=["synthetic", "plain"],
            options=_batch(64, 1) + ["--rounds", "3", "--deepspeed_config", PRECISIONS[p].json],
        )
        for p in ("fp32", "bf16")
    ]
    ranks = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_ranks]
    cases += [
        TrainCase(
            sweep="weak",
            label=f"{n} rank(s), micro 64",
            ranks=n,
            modes=["synthetic", "full", "plain"],
            options=_batch(64, n),
        )
        for n in ranks
    ]
    cases += [
        TrainCase(
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


def gpu_speed(max_ranks: int) -> tuple[list[str], list[TrainCase]]:
    """One GPU, the reference model at 64^3, batch 64: the headline (sweep "headline"), then fp16 and bf16 with each
    fast path off and on (sweep "speed")."""
    base, _ = gpu(max_ranks)
    every = [option for switch in FAST_PATHS.values() for option in switch]

    def case(
        precision: str, what: str, switches: list[str], *, sweep: str = "speed", modes=("synthetic", "full")
    ) -> TrainCase:
        common = _batch(64, 1) + ["--deepspeed_config", PRECISIONS[precision].json, "--warmup", "10"] + PLAIN_PATH
        return TrainCase(
            sweep=sweep, label=f"{precision} {what}", ranks=1, modes=list(modes), options=common + switches
        )

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


def gpu_comm(max_ranks: int) -> tuple[list[str], list[TrainCase]]:
    """Weak scaling with ZeRO stage 0 (all-reduce after backward), stage 0 with its reduction overlapped with backward
    (two bucket sizes), 1 and 2 (overlapped reduction); then, at the most ranks, ZeRO 2's bucket sizes and overlap
    against ds_fp16_zero2.json's own (5e7, overlapped). One GPU has nothing to compare."""
    if max_ranks < 2:
        sys.exit("the gpu-comm preset compares reductions over several GPUs: this machine has one")
    base, _ = gpu(max_ranks)
    ranks = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_ranks]
    stage0 = ["--deepspeed_config", "ds_configs/ds_fp16.json"]
    variants = {
        "zero0": ("ZeRO 0", stage0),
        **{
            f"overlapped{mb}": (f"ZeRO 0 overlapped, {mb} MiB buckets", [*stage0, *_overlapped(mb)]) for mb in (25, 100)
        },
        "zero1": ("ZeRO 1", ["--deepspeed_config", "ds_configs/ds_fp16_zero1.json"]),
        "zero2": ("ZeRO 2", ["--deepspeed_config", "ds_configs/ds_fp16_zero2.json"]),
    }
    cases = [
        TrainCase(
            sweep=f"weak-{key}",
            label=f"{n} rank(s), micro 64, {what}",
            ranks=n,
            modes=["synthetic"],
            options=_batch(64, n) + options,
        )
        for key, (what, options) in variants.items()
        for n in ranks
    ]
    n = ranks[-1]
    if n > 1:
        zero2 = _batch(64, n) + [*variants["zero2"][1], "--deepspeed_overrides"]
        cases += [
            TrainCase(
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


def train_options(base: list[str], case: TrainCase, args: argparse.Namespace, *, run_id: str) -> list[str]:
    """The options of ``python -m bench.train`` for one case of a sweep: the user's override the case's."""
    return case.train_options(
        base, steps=args.steps, warmup=args.warmup, run_id=run_id, out=str(args.out), extra=args.train_options
    )


def check_cases(base: list[str], cases: list[TrainCase], args: argparse.Namespace, *, device_type: str) -> list[tuple]:
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
        mode = planned(cfg.storage)  # auto may keep host storage, which DALI reads on a GPU
        if resolve_backend(cfg.backend, device_type, mode) == "dali" and not dali_installed():
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
    if not torch.cuda.is_available() and not bf16_supported("cpu"):
        cases = [c for c in cases if c.label != "bf16"]
    compared = tuple(sorted({c.sweep for c in cases if sweep_of(c.sweep).repeated}))
    cases = interleave_repeats(cases, compared, args.scaling_repeats)
    cases = [c for c in cases if not args.only or c.sweep in args.only]
    checked = check_cases(base, cases, args, device_type="cuda" if torch.cuda.is_available() else "cpu")
    write_synthetic_data([cfg for _, cfg, _ in checked])
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S")
    failures = []
    for case in cases:
        starter = case.launcher(launcher=args.launcher, ranks_per_node=args.ranks_per_node)
        print(f"[{case.sweep}] {case.label} (run {case.repeat + 1}): {' '.join(case.modes)}", flush=True)
        launched = launch([*starter, *train_options(base, case, args, run_id=run_id)])
        if launched.returncode != 0:
            failures.append(case.label)
            print(launched.stderr[-3000:], file=sys.stderr)
    if not args.no_report:
        from bench.report import main as report

        report(["--results", str(args.out)])
    if failures:
        sys.exit(f"failed cases: {', '.join(failures)}")


if __name__ == "__main__":
    main()
