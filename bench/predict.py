"""Prediction at size, measured: the memory ``model.predict`` takes with its evaluation per voxel of the box, its
tiles/s per rank and the share of its time the model waits for input or output, for one and two ranks; bf16 against
fp32. ``--margin RUN``: how far into a sub-volume its faces cost accuracy, for each way of padding them.

    python -m bench.predict                        # 64^3, 256^3 and 384^3 boxes, the debug emulator's shape, CPU
    python -m bench.predict --margin runs/debug-...   # a trained run's emulator on a 128^3 LCDM box it never saw

The size cases use the emulator's initialization (speed and memory do not depend on training). One record per case
in bench/results/predict.jsonl; docs/prediction.md has the tables.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import psutil
import torch

from bench.cases import launch
from bench.env import REPO, append_records, environment
from bench.memory import DATA, random_box
from common.cli import ArgumentParser, existing_dir, output_file
from model.blocks import predict_volume
from model.emulator import Emulator, EmulatorSpec, export, from_run_dir
from model.tiling import Tiling, default_overlap
from model.unet import UNetSpec
from pipeline.synthetic import SyntheticSpec, write_box

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
    parser.add_argument("--margin", type=existing_dir, help="a trained run: measure the faces' margin instead")
    args = parser.parse_args(argv)
    if args.margin:
        env = environment()
        records = [{"bench": "predict-margin", **r, **env} for r in margins(args.margin)]
        append_records(args.out, records)
        for r in records:
            print(json.dumps({k: v for k, v in r.items() if k not in env}))
        return
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


MARGIN_BOX = 128  # an LCDM box the debug emulator never saw (its validation box is 64^3, seed 1)
SUB = 96  # sub-volumes of 96^3, not periodic, cut from it


def _predict(model: torch.nn.Module, volume: np.ndarray, tiling: Tiling) -> np.ndarray:
    out = np.empty((5, *volume.shape[1:]), dtype=np.float32)
    predict_volume(model, volume, tiling, out=out, batch=8, device=torch.device("cpu"))
    return out


def _by_distance(error: np.ndarray, size: int) -> np.ndarray:
    """Mean of a (size^3) error field by distance from the nearest face (0 .. size / 2 - 1)."""
    d = np.minimum(np.arange(size), np.arange(size)[::-1])
    distance = np.minimum(np.minimum(d[:, None, None], d[None, :, None]), d[None, None, :]).ravel()
    return np.bincount(distance, weights=error.ravel()) / np.bincount(distance)


def _margin_box() -> tuple[np.ndarray, np.ndarray]:
    path = DATA / f"lcdm_{MARGIN_BOX}.h5"
    if not path.exists():
        spec = SyntheticSpec(universe="lcdm", train_box_size=MARGIN_BOX, val_box_size=64, seed=7)
        write_box(path, spec, MARGIN_BOX, seed=7)
    with h5py.File(path, "r") as f:
        return f["Nbody"][...], f["Hydro"][...]


def margins(run_dir: Path) -> list[dict[str, Any]]:
    """For sub-volumes of a box with its truth, each way of padding the faces: L1 against the truth by distance from
    the faces over that of the whole (periodic) box's prediction at the same voxels, and the margin beyond which it
    stays within 10%; and how much moving the whole box's tile grid moves its values (the floor of any comparison)."""
    emulator = from_run_dir(run_dir)
    model, crop, vectors = emulator.model, emulator.spec.crop_size, tuple(map(tuple, emulator.spec.input_vectors))
    nbody, truth = _margin_box()
    periodic = Tiling(shape=nbody.shape[1:], crop=crop, overlap=default_overlap(crop))
    whole = _predict(model, nbody, periodic)
    shift = (crop - periodic.overlap) // 3
    moved = np.roll(_predict(model, np.roll(nbody, -shift, axis=(1, 2, 3)), periodic), shift, axis=(1, 2, 3))
    change = float(np.abs(moved - whole).mean() / np.abs(whole - truth).mean())
    records: list[dict[str, Any]] = [{"case": "grid moved", "shift": shift, "l1_change_over_l1": change}]
    for offset, pad, turned in itertools.product((16, 21), (0, crop // 8, crop // 4, crop // 2), (True, False)):
        region = (slice(None), *(slice(offset, offset + SUB),) * 3)
        base = _by_distance(np.abs(whole[region] - truth[region]).mean(axis=0), SUB)
        tiling = dataclasses.replace(
            periodic, shape=(SUB,) * 3, periodic=(False,) * 3, pad=pad, vectors=vectors if turned else ()
        )
        start = time.perf_counter()
        sub = _predict(model, nbody[region], tiling)
        wall = time.perf_counter() - start
        ratio = _by_distance(np.abs(sub - truth[region]).mean(axis=0), SUB) / base
        worse = np.flatnonzero(ratio > 1.1)
        records.append(
            {
                "case": "sub-volume",
                "run": str(run_dir),
                "offset": offset,
                "size": SUB,
                "crop": crop,
                "overlap": periodic.overlap,
                "pad": pad,
                "vectors_turned": turned,
                "margin_voxels": int(worse.max()) + 1 if worse.size else 0,
                "l1_ratio_by_distance": ratio[: crop + 1].tolist(),
                "tiles": len(tiling.starts) ** 3,
                "wall_s": wall,
            }
        )
    return records


def _bf16_error(fp32: Path, bf16: Path) -> list[float]:
    """Per channel, the largest difference of the bf16 prediction from the fp32 one over the channel's spread."""
    with h5py.File(fp32, "r", locking=False) as a, h5py.File(bf16, "r", locking=False) as b:
        x, y = a["Hydro"][...], b["Hydro"][...]
    return [float(np.abs(x[c] - y[c]).max() / x[c].std()) for c in range(x.shape[0])]


if __name__ == "__main__":
    main()
