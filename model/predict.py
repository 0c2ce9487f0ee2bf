"""Predict the full hydro volume of an N-body box with a trained emulator; compare it with the truth.

    python -m model.predict --input data/synthetic/lcdm/val.h5       # newest run under runs/
    python -m model.predict --run_dir RUN --input box.h5 --out RUN/prediction --overlap 16 --precision bf16
    deepspeed --num_gpus 4 --module model.predict --weights emulator.pt --input box_1024.h5   # or srun, torchrun

Writes OUT/prediction.h5 (``Hydro``, a virtual dataset over the slab files in OUT/prediction.slabs/, chunked, with
the input's attributes) and, with a truth at hand, OUT/metrics.json and the figures. The ranks share the slabs; a run
killed part way continues from its finished slabs. docs/prediction.md tells the memory it takes and its speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import torch.distributed as torch_dist

from common.cli import ArgumentParser, existing_dir, existing_file, output_dir
from common.files import written_atomically
from common.hold import HeldError, hold_directory
from common.launch import DistEnv, DistError, start_process_group
from common.tensors import DTYPES, tensor_digest
from model.blocks import Timing, predict_blocks
from model.emulator import Emulator, EmulatorError, from_run_dir, from_weights, latest_run
from model.figures import phases, slices, spectra
from model.metrics import Normalization, compare
from model.report import spectra_table
from model.tiling import Tiling, default_overlap
from pipeline.layout import HYDRO_CHANNELS, HYDRO_DATASET, NBODY_DATASET
from pipeline.volumes import DataError, open_hdf5, open_npy, read_hdf5

log = logging.getLogger("predict")

PREDICTION = "prediction.h5"
SLABS = "prediction.slabs"
CHUNK = 64  # chunks of 64^3 voxels of a channel


@contextmanager
def _opened(path: Path, dataset: str, layout: str) -> Iterator[tuple[Any, dict]]:
    """A (C, L, L, L) volume from an HDF5 dataset or a .npy file, and the file's attributes; closed after."""
    if path.suffix == ".npy":
        yield open_npy(path, layout), {}
        return
    volume = open_hdf5(path, dataset)
    try:
        yield volume, dict(volume.file.attrs)
    finally:
        volume.file.close()


def slab_blocks(tiling: Tiling, per_slab: int) -> list[list[int]]:
    """The blocks of each slab file: runs of ``per_slab`` consecutive blocks."""
    blocks = list(range(len(tiling.blocks)))
    return [blocks[i : i + per_slab] for i in range(0, len(blocks), per_slab)]


def _slab_path(out_dir: Path, index: int) -> Path:
    return out_dir / SLABS / f"slab-{index:04d}.h5"


def _finished(path: Path, params: str) -> bool:
    """Whether a slab file is there, whole, from this very prediction (same input, emulator and settings)."""
    try:
        with read_hdf5(path) as f:
            return f.attrs.get("params") == params
    except OSError:
        return False


class _SlabFiles:
    """The slab files a run of blocks goes into: each written under a hidden name as its blocks come, and given its
    final name once whole (a killed run leaves only whole slab files, and hidden ones that the next run replaces)."""

    def __init__(self, out_dir: Path, slabs: dict[int, list[int]], *, tiling: Tiling, params: str, **h5: Any) -> None:
        self.out_dir, self.slabs, self.tiling, self.params, self.h5 = out_dir, slabs, tiling, params, h5
        self.open: dict[int, tuple[h5py.File, Path, set[int]]] = {}
        self.slab_of = {block: index for index, blocks in slabs.items() for block in blocks}

    def write(self, block: int, values: np.ndarray) -> None:
        index = self.slab_of[block]
        if index not in self.open:
            self._start(index)
        f, _, left = self.open[index]
        lo = self.tiling.blocks[self.slabs[index][0]][0]
        a, b = self.tiling.blocks[block]
        f[HYDRO_DATASET][:, a - lo : b - lo] = values
        left.discard(block)
        if not left:
            self._finish(index)

    def _start(self, index: int) -> None:
        blocks, box = self.slabs[index], self.tiling.shape[0]
        lo, hi = self.tiling.blocks[blocks[0]][0], self.tiling.blocks[blocks[-1]][1]
        final = _slab_path(self.out_dir, index)
        partial = final.with_name(f".{final.name}.partial")
        f = h5py.File(partial, "w")
        channels = self.h5["channels"]
        chunks = (1, min(CHUNK, hi - lo), min(CHUNK, box), min(CHUNK, box))
        options = {k: v for k, v in self.h5.items() if k != "channels"}
        f.create_dataset(HYDRO_DATASET, shape=(channels, hi - lo, box, box), dtype=np.float32, chunks=chunks, **options)
        f.attrs["planes"], f.attrs["params"] = (lo, hi), self.params
        self.open[index] = (f, partial, set(blocks))

    def _finish(self, index: int) -> None:
        f, partial, _ = self.open.pop(index)
        f.close()
        os.replace(partial, _slab_path(self.out_dir, index))

    def close(self) -> None:
        """Where a run stopped part way: its unfinished slab files go."""
        for f, partial, _ in self.open.values():
            f.close()
            partial.unlink(missing_ok=True)
        self.open.clear()


def _share(slabs: list[list[int]], *, rank: int, ranks: int) -> list[int]:
    """This rank's slabs: a run of them whose blocks are as near a rank's share of all blocks as whole slabs allow."""
    total = sum(len(s) for s in slabs)
    starts = np.cumsum([0] + [len(s) for s in slabs[:-1]])
    return [i for i, start in enumerate(starts) if rank * total // ranks <= start < (rank + 1) * total // ranks]


def _runs_of(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of ``indices``: their blocks are predicted in one go, a row before each run added."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def predict_file(
    emulator: Emulator,
    input_path: Path,
    out_dir: Path,
    *,
    overlap: int,
    batch: int,
    device: torch.device,
    dist: DistEnv | None = None,
    layout: str = "CDHW",
    precision: str = "fp32",
    compression: str | None = None,
    per_slab: int = 2,
) -> dict[str, Any]:
    """This rank's slabs of the prediction of ``input_path`` into ``out_dir``'s slab files (those finished by an
    earlier run of the same prediction kept); its timing."""
    spec, rank, ranks = emulator.spec, (dist.rank if dist else 0), (dist.world_size if dist else 1)
    if not 0 <= overlap < spec.crop_size:
        crop = spec.crop_size
        raise ValueError(f"overlap {overlap} must be in [0, {crop}) for this emulator's {crop}^3 tiles")
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("--precision fp16 needs a GPU: bf16 on a CPU")
    with _opened(input_path, NBODY_DATASET, layout) as (volume, _):
        if volume.ndim != 4 or volume.shape[0] != spec.in_channels or len(set(volume.shape[1:])) != 1:
            shape = tuple(volume.shape)
            raise DataError(f"{input_path}: inputs of shape {shape}; the emulator takes ({spec.in_channels}, L, L, L)")
        tiling = Tiling(shape=tuple(volume.shape[1:]), crop=spec.crop_size, overlap=overlap)
        params = _params(emulator, input_path, tiling=tiling, precision=precision, compression=compression)
        slabs = slab_blocks(tiling, per_slab)
        mine = _share(slabs, rank=rank, ranks=ranks)
        todo = [i for i in mine if not _finished(_slab_path(out_dir, i), params)]
        if rank == 0:
            what = f"{spec.crop_size}^3 tiles, overlap {overlap}, {precision}, on {ranks} rank(s)"
            log.info(
                "predicting %s (%d^3) with %s: %s; %d slab(s) of %d to do here",
                *(input_path, tiling.shape[0], emulator.source, what, len(todo), len(mine)),
            )
        model = emulator.model.to(device=device, dtype=DTYPES[precision])
        timing, start = Timing(), time.perf_counter()
        h5 = {"channels": spec.out_channels} | ({"compression": compression} if compression else {})
        for run in _runs_of(todo):
            files = _SlabFiles(out_dir, {i: slabs[i] for i in run}, tiling=tiling, params=params, **h5)
            blocks = [block for index in run for block in slabs[index]]
            found = predict_blocks(
                model,
                volume,
                tiling,
                blocks=blocks,
                out_channels=spec.out_channels,
                batch=batch,
                device=device,
                timing=timing,
            )
            try:
                for block, values in found:
                    files.write(block, values)
            finally:
                files.close()
    return timing.as_dict(time.perf_counter() - start)


def _params(emulator: Emulator, input_path: Path, *, tiling: Tiling, precision: str, compression: str | None) -> str:
    """What makes a slab this prediction's: the input (path, size, time), the emulator and the settings."""
    stat = input_path.stat()
    weights = tensor_digest(emulator.model.state_dict().values())  # every value: a retrained run's slabs are not kept
    return json.dumps(
        {
            "input": [str(input_path.resolve()), stat.st_size, stat.st_mtime_ns],
            "emulator": [emulator.source, weights[:16]],
            "tiles": [tiling.shape[0], tiling.crop, tiling.overlap],
            "precision": precision,
            "compression": compression,
        },
        sort_keys=True,
    )


def assemble(out_dir: Path, *, input_path: Path, attrs: dict, tiling: Tiling, channels: int, info: dict) -> Path:
    """``prediction.h5``: one ``Hydro`` dataset over the slab files (a virtual dataset: nothing copied), with the
    input's attributes; written under its final name only once whole."""
    box = tiling.shape[0]
    layout = h5py.VirtualLayout(shape=(channels, box, box, box), dtype=np.float32)
    for path in sorted((out_dir / SLABS).glob("slab-*.h5")):
        with read_hdf5(path) as f:
            lo, hi = (int(v) for v in f.attrs["planes"])
        source = h5py.VirtualSource(os.path.relpath(path, out_dir), HYDRO_DATASET, shape=(channels, hi - lo, box, box))
        layout[:, lo:hi] = source
    out = out_dir / PREDICTION
    with written_atomically(out) as partial, h5py.File(partial, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs["prediction"] = json.dumps({"input": str(input_path), **info})
        hydro = f.create_virtual_dataset(HYDRO_DATASET, layout, fillvalue=np.nan)
        hydro.attrs["channels"] = json.dumps(HYDRO_CHANNELS)
    return out


def evaluate_file(prediction: Path, truth: Path, inputs: Path, *, out_dir: Path, layout: str = "CDHW") -> dict:
    """The metrics of the prediction against the truth, read a slab at a time, into metrics.json, and the figures."""
    with _opened(truth, HYDRO_DATASET, layout) as (true, attrs), read_hdf5(prediction) as f:
        pred = f[HYDRO_DATASET]
        if tuple(true.shape) != pred.shape:
            raise DataError(f"{truth}: true hydro {tuple(true.shape)} and prediction {pred.shape} differ")
        norm = Normalization.from_attrs(attrs)
        metrics = compare(pred, true, norm)
        metrics["files"] = {"prediction": str(prediction), "truth": str(truth)}
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        with _opened(inputs, NBODY_DATASET, layout) as (input_volume, _):
            slices(
                input_volume, true, pred, path=out_dir / "slices.png", temperature_log_range=norm.temperature_log_range
            )
    spectra(metrics, out_dir / "spectra.png")
    phases(metrics, out_dir / "phases.png")
    return metrics


def _agree(dist: DistEnv | None, failed: str) -> str:
    """Every rank's first failure (one line), or "" where none failed."""
    if dist is None or dist.world_size == 1:
        return failed
    said: list[str] = [""] * dist.world_size
    torch_dist.all_gather_object(said, failed)
    return next((s for s in said if s), "")


def run(args: Namespace, dist: DistEnv | None) -> int:
    """Every rank predicts its slabs; rank 0 then assembles the file and evaluates it. Exit status."""
    rank0 = dist is None or dist.is_main
    failed, timing, emulator, out_dir = "", {}, None, None
    try:
        if args.weights:
            emulator, default_out = from_weights(args.weights), args.weights.with_suffix("")
        else:
            emulator, default_out = from_run_dir(args.run_dir, args.tag), args.run_dir / "prediction"
        out_dir = args.out or default_out
        (out_dir / SLABS).mkdir(parents=True, exist_ok=True)
        overlap = default_overlap(emulator.spec.crop_size) if args.overlap is None else args.overlap
        timing = predict_file(
            emulator,
            args.input,
            out_dir,
            overlap=overlap,
            batch=args.batch,
            device=torch.device(args.device),
            dist=dist,
            layout=args.npy_layout,
            precision=args.precision,
            compression=None if args.compression == "none" else args.compression,
            per_slab=args.slab_blocks,
        )
    except (DataError, EmulatorError, FileNotFoundError, ValueError, OSError) as err:
        failed = " ".join(str(err).split()) or type(err).__name__
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
    return _finish(args, emulator, out_dir, overlap=overlap, timings=timings)


def _finish(args: Namespace, emulator: Emulator, out_dir: Path, *, overlap: int, timings: list[dict]) -> int:
    """Rank 0, once every slab is written: the prediction file, then its metrics where a truth is at hand."""
    try:
        with _opened(args.input, NBODY_DATASET, args.npy_layout) as (volume, attrs):
            tiling = Tiling(shape=tuple(volume.shape[1:]), crop=emulator.spec.crop_size, overlap=overlap)
        info = {"emulator": emulator.source, "crop": tiling.crop, "overlap": overlap, "precision": args.precision}
        info["ranks"] = timings  # each rank's tiles, rate, and where its time went
        prediction = assemble(
            out_dir, input_path=args.input, attrs=attrs, tiling=tiling, channels=emulator.spec.out_channels, info=info
        )
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
        metrics = evaluate_file(prediction, truth, args.input, out_dir=out_dir, layout=args.npy_layout)
    except (DataError, FileNotFoundError, ValueError, OSError) as err:
        log.error("%s", " ".join(str(err).split()))
        return 2
    log.info("L1 %.5f (mean over channels, normalized units)", metrics["l1_mean"])
    print(spectra_table(metrics), flush=True)
    figures = ", ".join(str(out_dir / name) for name in ("slices.png", "spectra.png", "phases.png"))
    log.info("wrote %s, %s", out_dir / "metrics.json", figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m model.predict", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--run_dir", type=existing_dir, help="run directory (default: the newest under runs/ with a checkpoint)"
    )
    source.add_argument("--weights", type=existing_file, help="an exported emulator (python -m model.export)")
    parser.add_argument("--tag", help="checkpoint tag of --run_dir (default: the latest)")
    parser.add_argument(
        "--input", type=existing_file, required=True, help="HDF5 file with an Nbody dataset, or a .npy input volume"
    )
    parser.add_argument("--npy_layout", choices=["CDHW", "DHWC", "bricks"], default="CDHW")
    parser.add_argument(
        "--truth",
        type=existing_file,
        help="HDF5 file (Hydro) or .npy targets to compare with (default: the input file)",
    )
    parser.add_argument("--out", type=output_dir, help="output directory (default: <run_dir>/prediction)")
    parser.add_argument("--overlap", type=int, help="voxels tiles overlap by (default: a quarter of the crop)")
    parser.add_argument("--batch", type=int, default=8, help="tiles per forward pass")
    parser.add_argument("--precision", choices=list(DTYPES), default="fp32", help="of the model (fp16: GPUs)")
    parser.add_argument("--compression", choices=["none", "gzip", "lzf"], default="none", help="of the output's chunks")
    parser.add_argument("--slab_blocks", type=int, default=2, help="rows of tiles per slab file (the unit of resuming)")
    parser.add_argument("--dist_timeout_s", type=float, default=1800.0, help="how long a rank waits for the others")
    parser.add_argument("--device", help="default: this rank's GPU where there is one, else the CPU")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.slab_blocks < 1:
        parser.error(f"--slab_blocks must be positive, got {args.slab_blocks}")
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


def _held(args: Namespace, dist: DistEnv) -> int:
    """The prediction, its output directory held by rank 0 for the job (every rank refused alike)."""
    hold, refused = None, ""
    if dist.is_main:
        try:
            if not args.weights and args.run_dir is None:
                args.run_dir = latest_run()  # found once, here: every rank predicts with this run's weights
            out = args.out or (args.weights.with_suffix("") if args.weights else args.run_dir / "prediction")
            hold = hold_directory(out, "wait for it to end, or choose another --out")
        except (HeldError, EmulatorError) as err:
            refused = str(err)
    refused = _agree(dist, refused)
    if refused:
        log.error("%s", refused)
        return 2
    if dist.world_size > 1:
        shared = [args.run_dir]
        torch_dist.broadcast_object_list(shared, src=0)
        args.run_dir = shared[0]
    try:
        return run(args, dist if dist.world_size > 1 else None)
    finally:
        if hold is not None:
            hold.release()


if __name__ == "__main__":
    sys.exit(main())
