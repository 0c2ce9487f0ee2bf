"""Predict the full hydro volume of an N-body box with a trained emulator; compare it with the truth.

    python -m model.predict --input data/synthetic/lcdm/val.h5       # newest run under runs/
    python -m model.predict --run_dir RUN --input box.h5 --out RUN/prediction --overlap 16
    python -m model.predict --weights emulator.pt --input nbody_data.npy --npy_layout DHWC --truth box.h5

Writes OUT/prediction.h5 (a ``Hydro`` dataset in the input's layout, its attributes copied), and
where a true ``Hydro`` is at hand (the input file's own, or --truth) OUT/metrics.json and the
figures OUT/slices.png, OUT/spectra.png and OUT/phases.png. Tiles are cut from the input one batch at a time and
blended into accumulators kept on disk (float64, 48 bytes per voxel in OUT), so device and host
memory stay bounded whatever the box size.
"""

from __future__ import annotations

import json
import logging
import sys
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from common.cli import ArgumentParser, existing_dir, existing_file, output_dir
from common.hold import hold_directory
from model.emulator import Emulator, from_run_dir, from_weights, latest_run
from model.figures import phases, slices, spectra
from model.metrics import Normalization, compare, spectra_table
from model.tiling import accumulate, predict_box
from pipeline.layout import HYDRO_CHANNELS, HYDRO_DATASET, NBODY_DATASET
from pipeline.volumes import DataError, open_hdf5, open_npy, read_hdf5

log = logging.getLogger("predict")


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


def predict_file(
    emulator: Emulator,
    input_path: Path,
    out_dir: Path,
    *,
    overlap: int,
    batch: int,
    device: torch.device,
    layout: str = "CDHW",
) -> Path:
    spec = emulator.spec
    if not 0 <= overlap < spec.crop_size:
        crop = spec.crop_size
        raise ValueError(f"overlap {overlap} must be in [0, {crop}) for this emulator's {crop}^3 tiles")
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    with _opened(input_path, NBODY_DATASET, layout) as (volume, attrs):
        return _predict_volume(
            emulator, volume, attrs, input_path=input_path, out_dir=out_dir, overlap=overlap, batch=batch, device=device
        )


def _predict_volume(
    emulator: Emulator,
    volume: Any,
    attrs: dict,
    *,
    input_path: Path,
    out_dir: Path,
    overlap: int,
    batch: int,
    device: torch.device,
) -> Path:
    spec = emulator.spec
    if volume.ndim != 4 or volume.shape[0] != spec.in_channels or len(set(volume.shape[1:])) != 1:
        raise DataError(
            f"{input_path}: inputs of shape {tuple(volume.shape)}; the emulator takes ({spec.in_channels}, L, L, L)"
        )
    box = volume.shape[1]
    out_dir.mkdir(parents=True, exist_ok=True)
    acc_path, wsum_path = out_dir / ".accumulator.npy", out_dir / ".weights.npy"
    acc = np.lib.format.open_memmap(acc_path, mode="w+", dtype=np.float64, shape=(spec.out_channels, box, box, box))
    wsum = np.lib.format.open_memmap(wsum_path, mode="w+", dtype=np.float64, shape=(box, box, box))
    log.info(
        "predicting %s (%d^3) with %s: %d^3 tiles, overlap %d, on %s",
        input_path,
        box,
        emulator.source,
        spec.crop_size,
        overlap,
        device,
    )
    accumulate(
        emulator.model.to(device),
        volume,
        spec.crop_size,
        overlap=overlap,
        batch=batch,
        device=device,
        acc=acc,
        wsum=wsum,
        progress=sys.stderr.isatty(),
    )
    out = out_dir / "prediction.h5"
    with h5py.File(out, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs["prediction"] = json.dumps(
            {"input": str(input_path), "emulator": emulator.source, "crop": spec.crop_size, "overlap": overlap}
        )
        hydro = f.create_dataset(HYDRO_DATASET, shape=(spec.out_channels, box, box, box), dtype=np.float32)
        hydro.attrs["channels"] = json.dumps(HYDRO_CHANNELS)
        for c in range(spec.out_channels):  # one channel at a time: memory stays at one channel of the box
            hydro[c] = (acc[c] / wsum).astype(np.float32)
    del acc, wsum
    acc_path.unlink()
    wsum_path.unlink()
    return out


def compare_box(
    model: torch.nn.Module,
    nbody: Any,
    hydro: Any,
    *,
    norm: Normalization,
    crop: int,
    batch: int,
    device: torch.device,
    side: int | None = None,
) -> dict:
    """``compare``'s metrics of the model's prediction of a box against its truth: the whole box, or the fixed
    ``side``^3 sub-volume at its origin taken as periodic, tiled with a quarter-crop overlap as ``predict_file``
    tiles by default (the trainer's science metrics)."""
    side = side or nbody.shape[1]
    region = np.s_[:, :side, :side, :side]
    pred = predict_box(
        model, np.asarray(nbody[region]), hydro.shape[0], crop=crop, overlap=crop // 4, batch=batch, device=device
    )
    return compare(pred, np.asarray(hydro[region], dtype=np.float32), norm)


def evaluate_file(prediction: Path, truth: Path, inputs: Path, *, out_dir: Path, layout: str = "CDHW") -> dict:
    with _opened(truth, HYDRO_DATASET, layout) as (true_volume, attrs):
        true = np.asarray(true_volume[...], dtype=np.float32)
    with read_hdf5(prediction) as f:
        pred = f[HYDRO_DATASET][...]
    if true.shape != pred.shape:
        raise DataError(f"{truth}: true hydro {true.shape} and prediction {pred.shape} differ")
    norm = Normalization.from_attrs(attrs)
    metrics = compare(pred, true, norm)
    metrics["files"] = {"prediction": str(prediction), "truth": str(truth)}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    with _opened(inputs, NBODY_DATASET, layout) as (input_volume, _):
        input_array = np.asarray(input_volume[...], dtype=np.float32)
    slices(
        input_array,
        true,
        pred,
        path=out_dir / "slices.png",
        temperature_log_range=norm.temperature_log_range,
    )
    spectra(metrics, out_dir / "spectra.png")
    phases(metrics, out_dir / "phases.png")
    return metrics


def _predict(args: Namespace, emulator: Emulator, out_dir: Path) -> None:
    """Predict into ``out_dir`` and, where a truth is at hand, evaluate the prediction there."""
    overlap = emulator.spec.crop_size // 4 if args.overlap is None else args.overlap
    prediction = predict_file(
        emulator,
        args.input,
        out_dir,
        overlap=overlap,
        batch=args.batch,
        device=torch.device(args.device),
        layout=args.npy_layout,
    )
    log.info("wrote %s", prediction)
    truth = args.truth or (args.input if args.input.suffix != ".npy" else None)
    if truth is None:
        return
    if truth.suffix != ".npy":
        with read_hdf5(truth) as f:
            has_truth = HYDRO_DATASET in f
        if not has_truth:
            log.info("%s holds no %s: no metrics", truth, HYDRO_DATASET)
            return
    metrics = evaluate_file(prediction, truth, args.input, out_dir=out_dir, layout=args.npy_layout)
    log.info("L1 %.5f (mean over channels, normalized units)", metrics["l1_mean"])
    print(spectra_table(metrics), flush=True)
    figures = ", ".join(str(out_dir / name) for name in ("slices.png", "spectra.png", "phases.png"))
    log.info("wrote %s, %s", out_dir / "metrics.json", figures)


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
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        if args.weights:
            emulator, default_out = from_weights(args.weights), args.weights.with_suffix("")
        else:
            run_dir = args.run_dir or latest_run()
            emulator, default_out = from_run_dir(run_dir, args.tag), run_dir / "prediction"
        out_dir = args.out or default_out
        with hold_directory(out_dir, "wait for it to end, or choose another --out"):
            _predict(args, emulator, out_dir)
    except (DataError, FileNotFoundError, ValueError) as err:
        log.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
