"""Prediction at size, measured: the memory ``model.predict`` takes with its evaluation per voxel of the box, its
tiles/s per rank and the share of its time the model waits for input or output, for one and two ranks; bf16 against
fp32.

    python -m bench.predict                        # 64^3, 256^3 and 384^3 boxes, the debug emulator's shape, CPU

The emulator's weights are its initialization (speed and memory do not depend on training). One record per case in
bench/results/predict.jsonl; docs/prediction.md has the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import psutil
import torch

from bench.cases import launch
from bench.env import REPO, append_records, environment
from bench.memory import DATA, random_box
from common.cli import ArgumentParser, output_file
from model.emulator import Emulator, EmulatorSpec, export
from model.unet import UNetSpec

RESULTS = REPO / "bench" / "results" / "predict.jsonl"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]


def emulator(path: Path) -> Path:
    """The debug config's network (width 16, depth 5, 32^3 tiles), as initialized, exported once."""
    if not path.exists():
        spec = EmulatorSpec(
            in_channels=4,
            out_channels=5,
            width=16,
            depth=5,
            crop_size=32,
            input_vectors=[[1, 2, 3]],
            target_vectors=[[1, 2, 3]],
        )
        torch.manual_seed(0)
        model = UNetSpec(in_channels=4, out_channels=5, width=16, depth=5).build()
        export(Emulator(spec=spec, model=model, source="bench.predict (initialized)"), path)
    return path


def case(weights: Path, box: int, out: Path, *, ranks: int, precision: str = "fp32") -> dict[str, Any]:
    """One prediction and its evaluation: the peak drop of MemAvailable under it, and its ranks' timings."""
    command = [*TORCHRUN, str(ranks), "-m"] if ranks > 1 else [sys.executable, "-m"]
    args = ["model.predict", "--weights", str(weights), "--input", str(random_box(DATA / f"random_{box}.h5", box))]
    args += ["--out", str(out), "--precision", precision]
    for stale in out.glob("prediction.slabs/slab-*.h5"):  # a case measures the whole prediction
        stale.unlink()
    baseline, lowest = psutil.virtual_memory().available, [psutil.virtual_memory().available]

    def sample(_: int) -> None:
        lowest[0] = min(lowest[0], psutil.virtual_memory().available)

    launched = launch([*command, *args], watch=sample)
    if launched.returncode != 0:
        sys.exit(f"model.predict failed:\n{launched.output[-3000:]}")
    with h5py.File(out / "prediction.h5", "r", locking=False) as f:
        ranks_timing = json.loads(f.attrs["prediction"])["ranks"]
    drop = (baseline - lowest[0]) / 2**30
    return {"box": box, "ranks": ranks, "precision": precision, "peak_drop_gib": drop, "per_rank": ranks_timing}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bench.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--boxes", type=int, nargs="+", default=[64, 256, 384], help="the first is the baseline")
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    args = parser.parse_args(argv)
    runs = REPO / "runs" / "bench-predict"
    weights = emulator(runs / "emulator.pt")
    env, records = environment(), []
    cases = [case(weights, box, runs / f"{box}", ranks=1) for box in args.boxes]
    small, big = cases[0], cases[-1]
    per_voxel = (big["peak_drop_gib"] - small["peak_drop_gib"]) * 2**30 / (big["box"] ** 3 - small["box"] ** 3)
    cases.append(case(weights, args.boxes[1], runs / f"{args.boxes[1]}-2", ranks=2))
    cases.append(case(weights, args.boxes[1], runs / f"{args.boxes[1]}-bf16", ranks=1, precision="bf16"))
    error = _bf16_error(runs / f"{args.boxes[1]}" / "prediction.h5", runs / f"{args.boxes[1]}-bf16" / "prediction.h5")
    records = [{"bench": "predict", **c, **env} for c in cases]
    records.append({"bench": "predict-summary", "bytes_per_voxel": per_voxel, "bf16_error": error, **env})
    append_records(args.out, records)
    print(json.dumps({"bytes_per_voxel": per_voxel, "bf16_max_error_over_std": error}, indent=1))
    for c in cases:
        rates = ", ".join(f"{r['tiles_per_s']:.1f} tiles/s (model {r['model_share']:.0%})" for r in c["per_rank"])
        print(f"{c['box']}^3, {c['ranks']} rank(s), {c['precision']}: {c['peak_drop_gib']:.2f} GiB; {rates}")


def _bf16_error(fp32: Path, bf16: Path) -> list[float]:
    """Per channel, the largest difference of the bf16 prediction from the fp32 one over the channel's spread."""
    with h5py.File(fp32, "r", locking=False) as a, h5py.File(bf16, "r", locking=False) as b:
        x, y = a["Hydro"][...], b["Hydro"][...]
    return [float(np.abs(x[c] - y[c]).max() / x[c].std()) for c in range(x.shape[0])]


if __name__ == "__main__":
    main()
