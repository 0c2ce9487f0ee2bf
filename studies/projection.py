"""A projection, labelled as one: the time to the base run's loss on N GPUs, from the convergence study's steps per
global batch, a step time per GPU and a ring all-reduce of the named configs' gradients.

    python -m studies.projection                      # the fit of bench/results/convergence.jsonl, the defaults
    python -m studies.projection --s_min 2600 --e_min 4.6e6 --study_base_batch 8 --step_ms 46.5 --overlap

Steps to the base's loss at global batch B = 64 N (64 a GPU, as the named configs): S(B) = S_min + E_min / B, the fit
of McCandlish et al. that the study measures (docs/training.md, Large batches), scaled to the reference's run (its
base run's steps at 64). A step takes the GPU's time plus the all-reduce's exposed part: 2 (N-1)/N x bytes / bandwidth
+ 2 (N-1) x latency, all of it without overlap, what backward does not cover with it. Every input is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.env import read_records
from common.cli import ArgumentParser
from studies.convergence import RESULTS
from studies.convergence_report import fits

# bs64_opt at 64 samples a GPU: 1,377 samples/s on one H200 (measured before the fp16 fixes; docs/benchmarks.md).
STEP_MS = 64 / 1377 * 1000
GRADIENT_BYTES = 116_977_029 * 2  # the reference's U-Net, fp16 gradients
BASE_STEPS = 10_240  # bs64_opt: 10 epochs of 65,536 samples at 64
BACKWARD_SHARE = 2 / 3  # of a step: the part an overlapped reduction can hide behind (forward 1, backward 2)


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """What the projection assumes; each printed beside its result."""

    s_min: float  # the fit's, in the study's steps
    e_min: float  # the fit's, in the study's samples
    study_base_batch: float  # the study's batch that stands for 64 a GPU on one GPU
    step_ms: float = STEP_MS
    gradient_bytes: float = float(GRADIENT_BYTES)
    bandwidth_gbs: float = 100.0  # per node: 4 NICs of 25 GB/s
    latency_us: float = 5.0
    overlap: bool = False
    base_steps: float = float(BASE_STEPS)


def steps_at(inputs: Inputs, multiple: float) -> float:
    """Optimizer steps to the base's loss at ``multiple`` times the base batch: the reference's base steps times the
    fit's ratio of steps at that batch to steps at the base batch."""
    steps = lambda m: inputs.s_min + inputs.e_min / (m * inputs.study_base_batch)  # noqa: E731
    return inputs.base_steps * steps(multiple) / steps(1)


def allreduce_ms(inputs: Inputs, gpus: int) -> float:
    """A ring all-reduce of the gradients over ``gpus`` ranks: bandwidth and latency terms, in milliseconds."""
    if gpus == 1:
        return 0.0
    ring = 2 * (gpus - 1) / gpus * inputs.gradient_bytes / (inputs.bandwidth_gbs * 1e9)
    return 1000 * (ring + 2 * (gpus - 1) * inputs.latency_us * 1e-6)


def project(inputs: Inputs, gpus: int) -> dict[str, float]:
    """Time to the base's loss on ``gpus`` GPUs at 64 samples each."""
    reduce_ms = allreduce_ms(inputs, gpus)
    exposed = max(0.0, reduce_ms - BACKWARD_SHARE * inputs.step_ms) if inputs.overlap else reduce_ms
    steps = steps_at(inputs, gpus)
    step_ms = inputs.step_ms + exposed
    return {
        "gpus": gpus,
        "global_batch": 64 * gpus,
        "steps": steps,
        "step_ms": step_ms,
        "allreduce_ms": reduce_ms,
        "exposed_ms": exposed,
        "minutes": steps * step_ms / 60_000,
    }


def worth_it(rows: list[dict[str, float]]) -> int:
    """The GPU count beyond which the time to solution stops falling (by 5% or more)."""
    best = rows[0]
    for row in rows[1:]:
        if row["minutes"] > 0.95 * best["minutes"]:
            return int(best["gpus"])
        best = row
    return int(best["gpus"])


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m studies.projection", description=__doc__.split("\n\n")[0])
    for name, default in asdict(Inputs(s_min=0, e_min=0, study_base_batch=0)).items():
        if isinstance(default, bool):
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default)
        else:
            required = name in ("s_min", "e_min", "study_base_batch")  # the study's fit: no default
            parser.add_argument(f"--{name}", type=float, default=None if required else default)
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 4, 8, 32, 128])
    parser.add_argument("--records", type=Path, default=RESULTS, help="the study's, for a fit not given")
    args = parser.parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k not in ("gpus", "records")}
    if any(fields[k] is None for k in ("s_min", "e_min", "study_base_batch")):
        found = fits(read_records(args.records)) if args.records.is_file() else []
        if not found:
            parser.error(f"no fit in {args.records}: give --s_min --e_min --study_base_batch")
        for index, key in enumerate(("s_min", "e_min", "study_base_batch")):  # the mean of the seeds' fits
            fields[key] = fields[key] if fields[key] is not None else statistics.mean(f[index] for f in found)
    inputs = Inputs(**fields)
    rows = [project(inputs, n) for n in args.gpus]
    print("A projection, not a measurement. Inputs:", json.dumps(asdict(inputs)))
    print("| GPUs | global batch | steps to the base's loss | step ms (exposed all-reduce) | minutes |")
    print("| ---: | ---: | ---: | --- | ---: |")
    for row in rows:
        print(
            f"| {row['gpus']} | {row['global_batch']} | {row['steps']:.0f} | {row['step_ms']:.1f} "
            f"({row['exposed_ms']:.1f} of {row['allreduce_ms']:.1f}) | {row['minutes']:.1f} |"
        )
    worth = worth_it(rows)
    if worth == rows[-1]["gpus"]:
        print(f"The time to solution still falls by 5% or more at {worth} GPUs, the most asked for.")
    else:
        print(f"The time to solution stops falling (by 5% or more) beyond {worth} GPUs.")


if __name__ == "__main__":
    main()
