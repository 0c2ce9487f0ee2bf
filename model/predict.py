"""Predict the full hydro volume of an N-body box with a trained emulator; compare it with the truth.

    python -m model.predict --input data/synthetic/lcdm/val.h5       # newest run under runs/
    python -m model.predict --run_dir RUN --input box.h5 --out RUN/prediction --overlap 16 --precision bf16
    python -m model.predict --weights emulator.pt --input zoom.h5 --boundary mirror       # a sub-volume, not periodic
    deepspeed --num_gpus 4 --module model.predict --weights emulator.pt --input box_1024.h5   # or srun, torchrun

Writes OUT/prediction.h5 (``Hydro``, a virtual dataset over the slab files in OUT/prediction.slabs/, chunked, with
the input's attributes) and, with a truth at hand, OUT/metrics.json and the figures. Boxes of any shape, periodic or
not along each axis. The ranks share the slabs; a killed run continues from its finished slabs; files in OUT that the
project did not write are never replaced. docs/prediction.md tells the memory it takes and its speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from common.cli import ArgumentParser, existing_dir, existing_file, output_dir
from common.files import write_text_atomically
from common.hold import HeldError, hold_directory
from common.launch import DistEnv, DistError, start_process_group
from common.outputs import OutputError, claim_directory, refuse_inputs
from common.tensors import DTYPES, tensor_digest
from model.blocks import Timing, predict_blocks
from model.emulator import Emulator, EmulatorError, from_run_dir, from_weights, latest_run
from model.figures import phases, slices, spectra
from model.metrics import Normalization, compare, edge_margin
from model.report import spectra_table
from model.slabs import (
    FIGURES,
    METRICS,
    OUTPUTS,
    SlabFiles,
    SlabPlan,
    assemble,
    earlier_prediction,
    reclaim_stale,
)
from model.tiling import BOUNDARIES, Tiling, default_overlap, default_pad
from pipeline.layout import HYDRO_DATASET, NBODY_DATASET
from pipeline.volumes import DataError, open_hdf5, open_npy, read_hdf5

log = logging.getLogger("predict")

# The voxels from a face that is not periodic within which the prediction is less accurate than inside, as a share of
# the crop: 1 measured with 32^3 tiles and an eighth of a crop of mirrored context, 2 without (docs/prediction.md).
MARGIN_OF_CROP = 1 / 16


@contextmanager
def _opened(path: Path, dataset: str, layout: str) -> Iterator[tuple[Any, dict]]:
    """A (C, L1, L2, L3) volume from an HDF5 dataset or a .npy file, and the file's attributes; closed after."""
    if path.suffix == ".npy":
        yield open_npy(path, layout), {}
        return
    volume = open_hdf5(path, dataset)
    try:
        yield volume, dict(volume.file.attrs)
    finally:
        volume.file.close()


def _runs_of(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of ``indices``: their blocks are predicted in one go, a row before each run added."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def plan_prediction(emulator: Emulator, args: Namespace) -> SlabPlan:
    """The tiling of the input box and its slab files, keyed by everything that decides the values."""
    spec = emulator.spec
    if args.batch < 1:
        raise ValueError(f"batch must be positive, got {args.batch}")
    if args.precision == "fp16" and not args.device.startswith("cuda"):
        raise ValueError("--precision fp16 needs a GPU: bf16 on a CPU")
    with _opened(args.input, NBODY_DATASET, args.npy_layout) as (volume, _):
        shape = tuple(int(n) for n in volume.shape)
    if len(shape) != 4 or shape[0] != spec.in_channels:
        raise DataError(f"{args.input}: inputs of shape {shape}; the emulator takes ({spec.in_channels}, L1, L2, L3)")
    crop = spec.crop_size
    tiling = Tiling(
        shape=shape[1:],
        crop=crop,
        overlap=default_overlap(crop) if args.overlap is None else args.overlap,
        periodic=tuple(b == "periodic" for b in args.boundary),
        pad=default_pad(crop) if args.pad is None else args.pad,
    )
    stat = args.input.stat()
    weights = tensor_digest(emulator.model.state_dict().values())  # every value: a retrained run's slabs are not kept
    params = {
        "input": [str(args.input.resolve()), stat.st_size, stat.st_mtime_ns],
        "emulator": [emulator.source, weights[:16]],
        "tiling": tiling.describe(),
        "precision": args.precision,
        "compression": args.compression,
        "slab_blocks": args.slab_blocks,
    }
    return SlabPlan(tiling=tiling, per_slab=args.slab_blocks, params=json.dumps(params, sort_keys=True))


def predict_file(
    emulator: Emulator, args: Namespace, plan: SlabPlan, *, out_dir: Path, dist: DistEnv | None
) -> dict[str, Any]:
    """This rank's slabs of the prediction into ``out_dir``'s slab files (those already finished kept); its timing."""
    spec, rank, ranks = emulator.spec, (dist.rank if dist else 0), (dist.world_size if dist else 1)
    mine = plan.share(rank=rank, ranks=ranks)
    todo = [i for i in mine if not plan.finished(out_dir, i)]
    tiling = plan.tiling
    if rank == 0:
        bounds = "periodic" if all(tiling.periodic) else "boundary " + ",".join(tiling.describe()["boundary"])
        what = f"{tiling.crop}^3 tiles, overlap {tiling.overlap}, {bounds}, {args.precision}, on {ranks} rank(s)"
        log.info(
            "predicting %s (%s) with %s: %s; %d slab(s) of %d to do here",
            *(args.input, "x".join(map(str, tiling.shape)), emulator.source, what, len(todo), len(mine)),
        )
    device = torch.device(args.device)
    model = emulator.model.to(device=device, dtype=DTYPES[args.precision])
    timing, start = Timing(), time.perf_counter()
    h5 = {"channels": spec.out_channels} | ({"compression": args.compression} if args.compression else {})
    with _opened(args.input, NBODY_DATASET, args.npy_layout) as (volume, _):
        for run in _runs_of(todo):
            files = SlabFiles(out_dir, plan, run, **h5)
            blocks = [block for index in run for block in plan.slabs[index]]
            found = predict_blocks(
                model,
                volume,
                tiling,
                blocks=blocks,
                out_channels=spec.out_channels,
                batch=args.batch,
                device=device,
                timing=timing,
            )
            try:
                for block, values in found:
                    files.write(block, values)
            finally:
                files.close()
    return timing.as_dict(time.perf_counter() - start)


def margin(tiling: Tiling) -> dict[str, Any]:
    """The margin of lesser accuracy along the faces that are not periodic: its width, and how it was found."""
    if all(tiling.periodic):
        return {"voxels": 0, "rule": "periodic along every axis: none"}
    voxels = max(1, round(MARGIN_OF_CROP * tiling.crop))
    return {"voxels": voxels, "rule": "a sixteenth of the crop, from the measured margin (docs/prediction.md)"}


def evaluate_file(prediction: Path, args: Namespace, *, tiling: Tiling, out_dir: Path) -> dict:
    """The metrics of the prediction against the truth, read a slab at a time, into metrics.json, and the figures
    (the spectra's only where the box is periodic)."""
    truth, layout = args.truth or args.input, args.npy_layout
    with _opened(truth, HYDRO_DATASET, layout) as (true, attrs), read_hdf5(prediction) as f:
        pred = f[HYDRO_DATASET]
        if tuple(true.shape) != pred.shape:
            raise DataError(f"{truth}: true hydro {tuple(true.shape)} and prediction {pred.shape} differ")
        norm = Normalization.from_attrs(attrs)
        metrics = compare(pred, true, norm, periodic=tiling.periodic)
        metrics["files"] = {"prediction": str(prediction), "truth": str(truth)}
        if "edges" in metrics:
            measured = edge_margin(metrics["edges"], interior_from=tiling.crop)
            rule = f"L1 more than 10% above that of the voxels {tiling.crop} or more from every face"
            metrics["margin"] = {"voxels": measured, "rule": rule, "expected": margin(tiling)["voxels"]}
        write_text_atomically(out_dir / METRICS, json.dumps(metrics, indent=1) + "\n")
        with _opened(args.input, NBODY_DATASET, layout) as (input_volume, _):
            log_range = norm.temperature_log_range
            slices(input_volume, true, pred, path=out_dir / FIGURES[0], temperature_log_range=log_range)
    if "edges" not in metrics:
        spectra(metrics, out_dir / FIGURES[1])
    phases(metrics, out_dir / FIGURES[2])
    return metrics


def _agree(dist: DistEnv | None, failed: str) -> str:
    """Every rank's first failure (one line), or "" where none failed."""
    if dist is None or dist.world_size == 1:
        return failed
    said: list[str] = [""] * dist.world_size
    torch_dist.all_gather_object(said, failed)
    return next((s for s in said if s), "")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def run(args: Namespace, dist: DistEnv | None, *, out_dir: Path) -> int:
    """Rank 0 reclaims what other runs left; every rank predicts its slabs; rank 0 assembles the file and evaluates
    it. Exit status."""
    rank0 = dist is None or dist.is_main
    failed, timing, emulator, plan = "", {}, None, None
    try:
        emulator = from_weights(args.weights) if args.weights else from_run_dir(args.run_dir, args.tag)
        plan = plan_prediction(emulator, args)
        if rank0:
            for line in reclaim_stale(out_dir, plan):
                log.warning("%s", line)
    except (DataError, EmulatorError, FileNotFoundError, ValueError, OSError) as err:
        failed = _one_line(err)
    failed = _agree(dist, failed)  # also: no rank looks for finished slabs before rank 0 has reclaimed the others
    if not failed:
        try:
            timing = predict_file(emulator, args, plan, out_dir=out_dir, dist=dist)
        except (DataError, FileNotFoundError, ValueError, OSError) as err:
            failed = _one_line(err)
        failed = _agree(dist, failed)
    if failed:
        log.error("%s", failed)
        return 2
    timings = [timing]
    if dist is not None:
        timings = [{}] * dist.world_size
        torch_dist.all_gather_object(timings, timing)
    for rank, each in enumerate(timings):
        log.info("rank %d: %s", rank, ", ".join(f"{k} {v:.3g}" for k, v in each.items()))
    if not rank0:
        return 0
    return _finish(args, emulator, plan, out_dir=out_dir, timings=timings)


def _finish(args: Namespace, emulator: Emulator, plan: SlabPlan, *, out_dir: Path, timings: list[dict]) -> int:
    """Rank 0, once every slab is written: the prediction file, then its metrics where a truth is at hand."""
    tiling = plan.tiling
    try:
        with _opened(args.input, NBODY_DATASET, args.npy_layout) as (_, attrs):
            pass
        info = {"input": str(args.input), "emulator": emulator.source, "precision": args.precision}
        info |= tiling.describe() | {"margin": margin(tiling), "ranks": timings}  # each rank's tiles, rate and waits
        channels = emulator.spec.out_channels
        prediction = assemble(out_dir, plan, attrs=attrs, channels=channels, info=info)
        log.info("wrote %s", prediction)
        truth = args.truth or (args.input if args.input.suffix != ".npy" else None)
        if truth is None:
            return 0
        if truth.suffix != ".npy":
            with read_hdf5(truth) as f:
                has_truth = HYDRO_DATASET in f
            if not has_truth:
                log.info("%s holds no %s: no metrics", truth, HYDRO_DATASET)
                return 0
        metrics = evaluate_file(prediction, args, tiling=tiling, out_dir=out_dir)
    except (DataError, FileNotFoundError, ValueError, OSError) as err:
        log.error("%s", _one_line(err))
        return 2
    log.info("L1 %.5f (mean over channels, normalized units)", metrics["l1_mean"])
    print(spectra_table(metrics), flush=True)
    figures = [out_dir / name for name in FIGURES if "edges" not in metrics or name != FIGURES[1]]
    log.info("wrote %s, %s", out_dir / METRICS, ", ".join(map(str, figures)))
    return 0


def _boundary(text: str) -> tuple[str, str, str]:
    """--boundary: one kind for every axis, or three (x, y, z) separated by commas."""
    kinds = [k.strip() for k in text.split(",")]
    if len(kinds) not in (1, 3) or any(k not in BOUNDARIES for k in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(BOUNDARIES)}, or three of them as x,y,z")
    return tuple(kinds * 3 if len(kinds) == 1 else kinds)


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m model.predict", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--run_dir", type=existing_dir, help="run directory (default: the newest under runs/)")
    source.add_argument("--weights", type=existing_file, help="an exported emulator (python -m model.export)")
    p.add_argument("--tag", help="checkpoint tag of --run_dir (default: the latest)")
    p.add_argument("--input", type=existing_file, required=True, help="HDF5 file with Nbody, or a .npy input volume")
    p.add_argument("--npy_layout", choices=["CDHW", "DHWC", "bricks"], default="CDHW")
    p.add_argument("--truth", type=existing_file, help="HDF5 file (Hydro) or .npy targets (default: the input file)")
    p.add_argument("--out", type=output_dir, help="output directory (default: <run_dir>/prediction)")
    p.add_argument("--beside", action="store_true", help="write into an --out that holds files of the user's")
    p.add_argument("--overlap", type=int, help="voxels tiles overlap by (default: a quarter of the crop)")
    p.add_argument(
        "--boundary",
        type=_boundary,
        default=("periodic",) * 3,
        help="periodic (default), or mirror where the box is a sub-volume; or one per axis, x,y,z",
    )
    p.add_argument("--pad", type=int, help="mirror: voxels of context beyond a face (default: an eighth of the crop)")
    p.add_argument("--batch", type=int, default=8, help="tiles per forward pass")
    p.add_argument("--precision", choices=list(DTYPES), default="fp32", help="of the model (fp16: GPUs)")
    p.add_argument("--compression", choices=["none", "gzip", "lzf"], default="none", help="of the output's chunks")
    p.add_argument("--slab_blocks", type=int, default=2, help="rows of tiles per slab file (the unit of resuming)")
    p.add_argument("--dist_timeout_s", type=float, default=1800.0, help="how long a rank waits for the others")
    p.add_argument("--device", help="default: this rank's GPU where there is one, else the CPU")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.slab_blocks < 1:
        parser().error(f"--slab_blocks must be positive, got {args.slab_blocks}")
    args.compression = None if args.compression == "none" else args.compression
    try:
        dist = DistEnv.from_environ()
        if dist.world_size > 1:
            start_process_group(dist, "gloo", None, timeout_s=args.dist_timeout_s)  # CPU barriers, on GPUs too
    except DistError as err:
        log.error("%s", err)
        return 2
    if not dist.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    if args.device is None or (args.device == "cuda" and torch.cuda.is_available()):  # each rank its own GPU
        args.device = f"cuda:{dist.local_rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    try:
        return _held(args, dist)
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def _claim(args: Namespace) -> tuple[Path, Any]:
    """Rank 0: the output directory, held for the job, checked to hold no file of the user's that would be replaced
    (nor, without --beside, any) and no input."""
    if not args.weights and args.run_dir is None:
        args.run_dir = latest_run()  # found once, here: every rank predicts with this run's weights
    out = args.out or (args.weights.with_suffix("") if args.weights else args.run_dir / "prediction")
    hold = hold_directory(out, "wait for it to end, or choose another --out")
    try:
        refuse_inputs([out / name for name in OUTPUTS], [args.input, args.truth, args.weights])
        advice = "choose another --out"
        claim_directory(out, OUTPUTS, by="model.predict", beside=args.beside, legacy=earlier_prediction, advice=advice)
    except BaseException:
        hold.release()
        raise
    return out, hold


def _held(args: Namespace, dist: DistEnv) -> int:
    """The prediction, its output directory held by rank 0 for the job (every rank refused alike)."""
    hold, refused, out = None, "", None
    if dist.is_main:
        try:
            out, hold = _claim(args)
        except (HeldError, EmulatorError, OutputError, OSError) as err:
            refused = _one_line(err)
    refused = _agree(dist, refused)
    if refused:
        log.error("%s", refused)
        return 2
    if dist.world_size > 1:
        shared = [args.run_dir, out]
        torch_dist.broadcast_object_list(shared, src=0)
        args.run_dir, out = shared
    try:
        return run(args, dist if dist.world_size > 1 else None, out_dir=out)
    finally:
        if hold is not None:
            hold.release()


if __name__ == "__main__":
    sys.exit(main())
