"""Gains per scale for gas density, temperature and the gas velocity, fitted on a prediction whose truth is known
(the training box's) and applied to another: the amplitude the network's smoothing leaves out, put back.

    python -m model.predict --run_dir RUN --input train.h5 --out RUN/prediction-train
    python -m model.calibrate --fit RUN/prediction-train/prediction.h5 --truth train.h5 --calibration RUN/gains.json
    python -m model.calibrate --calibration RUN/gains.json --apply RUN/prediction/prediction.h5 --truth val.h5 \
        --out RUN/calibrated

The gains multiply the Fourier modes of the network's own channels (log rho / 14, log10(T / T0) / range, v), so rho
and T stay positive; fitted by damped iterations on the training box, they bring the power of rho, T and v (one
gain for the three components) to the truth's in every shell to a quarter of Nyquist (the science target's),
tapered to 1 over half as far again, 1 at k = 0. Periodic boxes, whole in memory: about 50 bytes a voxel of the
training box to fit; the box's 20 and a channel's transform to apply. docs/prediction.md measures it.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import h5py
import numpy as np
import torch

from common.cli import ArgumentParser, existing_file, output_dir, output_file
from common.files import write_text_atomically
from common.outputs import OutputError, claim_directory, claim_files, refuse_inputs
from model.metrics import TRUTH_CUTOFF, Normalization, compare, contrast, spectra
from model.report import spectra_table
from pipeline.layout import GAS_DENSITY, HYDRO_CHANNELS, HYDRO_DATASET, TEMPERATURE, density, temperature
from pipeline.volumes import DataError, read_hdf5

log = logging.getLogger("calibrate")

# The fields a gain is fitted for, and their channels: the gas velocity's three share one gain per scale (its power
# summed over them), so that the gains turn with the box.
FIELDS = {
    "gas_density": (GAS_DENSITY,),
    "temperature": (TEMPERATURE,),
    "velocity": tuple(HYDRO_CHANNELS.index(v) for v in ("vx", "vy", "vz")),
}
GAIN_LIMITS = (0.5, 2.0)  # a gain outside these says the prediction is far off, not that the network smooths
TOLERANCE = 0.005  # the fit stops when every shell's power is within this of the truth's on the training box
DAMPING = 0.2  # the power of T = 10^(3 x) answers a gain on x faster than x's own: a full step overshoots
ITERATIONS = 30
PREDICTION, METRICS = "prediction.h5", "metrics.json"


def _power(name: str, channels: list[torch.Tensor], norm: Normalization) -> np.ndarray:
    """Per shell, the power the science metrics judge: of rho's and T's contrasts, of the velocity's channels
    themselves (summed)."""
    if name == "velocity":
        return sum(spectra(x.double().numpy())["p_a"] for x in channels)
    (x,) = channels
    values = density(x) if name == "gas_density" else temperature(x, norm.temperature_log_range)
    return spectra(contrast(values.double().numpy()))["p_a"]


def gain_grid(frequency: list[float], gain: list[float], shape: tuple[int, ...]) -> torch.Tensor:
    """The gain at every rfft mode of a grid of ``shape``, interpolated in |f| (cycles per voxel): 1 at f = 0,
    tapered from the last fitted frequency to 1 at 1.5 times it, 1 beyond."""
    freqs = [np.fft.fftfreq(n) for n in shape[:-1]] + [np.fft.rfftfreq(shape[-1])]
    f = np.sqrt(freqs[0][:, None, None] ** 2 + freqs[1][None, :, None] ** 2 + freqs[2][None, None, :] ** 2)
    values = np.interp(f, [0.0, *frequency, 1.5 * frequency[-1]], [1.0, *gain, 1.0], right=1.0)
    return torch.from_numpy(values.astype(np.float32))


def filtered(x: torch.Tensor, frequency: list[float], gain: list[float]) -> torch.Tensor:
    """A channel (L1, L2, L3) with its Fourier modes multiplied by the gains."""
    shape = tuple(x.shape)
    return torch.fft.irfftn(torch.fft.rfftn(x) * gain_grid(frequency, gain, shape), s=shape)


def fit(pred: Any, true: Any, norm: Normalization) -> dict[str, Any]:
    """The gains that bring each field's power in ``pred`` (a normalized (5, L, L, L) box) to ``true``'s in every
    shell to a quarter of Nyquist (and not beyond the truth's cut-off): g <- g (P_pred / P_true)^-DAMPING until
    within TOLERANCE. Per field: the frequencies (cycles per voxel), the gains, and the ratios before and after."""
    if norm.temperature_log_range is None:
        raise ValueError("the temperature's normalization is unknown: the truth's file does not say it")
    side = min(true.shape[1:])
    fields = {}
    for name, channels in FIELDS.items():
        read = lambda box, c: torch.from_numpy(np.ascontiguousarray(box[c], dtype=np.float32))  # noqa: E731
        x = [read(pred, c) for c in channels]
        p_true = _power(name, [read(true, c) for c in channels], norm)
        unresolved = np.flatnonzero(p_true <= TRUTH_CUTOFF * p_true.max())  # as the metrics leave them out
        last = min(side // 8, int(unresolved[0]) if unresolved.size else side // 8)
        if last == 0:  # a truth without fluctuations (no flows): nothing to fit
            fields[name] = {"frequency": [], "gain": []}
            continue
        frequency, gain = [k / side for k in range(1, last + 1)], np.ones(last)
        for iteration in range(ITERATIONS + 1):
            ratio = _power(name, [filtered(c, frequency, gain.tolist()) for c in x], norm)[:last] / p_true[:last]
            if not np.all(np.isfinite(ratio) & (ratio > 0)):
                raise ValueError(f"{name}: the prediction has no power in some of the shells to fit; no gain helps")
            if iteration == 0:
                before = ratio
            converged = bool(np.abs(ratio - 1).max() <= TOLERANCE)
            if converged or iteration == ITERATIONS:
                break  # the gains kept are those this ratio was measured with
            gain *= ratio**-DAMPING
        if not converged:
            log.warning("%s: the training box's power ratio is still %.3f-%.3f", name, ratio.min(), ratio.max())
        if not (GAIN_LIMITS[0] <= gain.min() and gain.max() <= GAIN_LIMITS[1]):
            raise ValueError(f"{name}: gains {gain.min():.2f}-{gain.max():.2f}: the prediction is too far off")
        fields[name] = {
            "frequency": frequency,
            "gain": gain.tolist(),
            "ratio_before": [float(before.min()), float(before.max())],
            "ratio_after": [float(ratio.min()), float(ratio.max())],
            "iterations": iteration,
            "converged": converged,
        }
    return {"fields": fields}


def apply(hydro: np.ndarray, calibration: dict[str, Any]) -> None:
    """Multiply each fitted field's channels' Fourier modes of a normalized (5, L1, L2, L3) box by its gains, in
    place."""
    for name, channels in FIELDS.items():
        fitted = calibration["fields"].get(name)
        if not fitted or not fitted["gain"]:
            continue
        for c in channels:
            hydro[c] = filtered(torch.from_numpy(hydro[c]), fitted["frequency"], fitted["gain"]).numpy()


def _read(path: Any) -> tuple[np.ndarray, dict[str, Any]]:
    with read_hdf5(path) as f:
        return f[HYDRO_DATASET][...].astype(np.float32), dict(f.attrs)


def _fit(args: Any) -> None:
    refuse_inputs([args.calibration], [args.fit, args.truth])
    if args.calibration.exists() and not args.overwrite:
        raise OutputError(f"{args.calibration} exists: --overwrite replaces it, or choose another --calibration")
    with read_hdf5(args.fit) as p, read_hdf5(args.truth) as t:
        pred, true = p[HYDRO_DATASET], t[HYDRO_DATASET]  # read a channel at a time
        if true.shape != pred.shape:
            raise DataError(f"{args.truth}: true hydro {true.shape} and prediction {pred.shape} differ")
        norm = Normalization.from_attrs(t.attrs)
        calibration = fit(pred, true, norm) | {"fitted_on": [str(args.fit), str(args.truth)]}
    claim_files([args.calibration], by="model.calibrate", overwrite=True, advice="choose another --calibration")
    write_text_atomically(args.calibration, json.dumps(calibration, indent=1) + "\n")
    for name, fitted in calibration["fields"].items():
        if not fitted["gain"]:
            log.info("%s: the truth has no fluctuations, no gains", name)
            continue
        log.info(
            "%s: gains %.3f-%.3f over %d shells; power ratio %.3f-%.3f before, %.3f-%.3f after (%d iterations)",
            *(name, min(fitted["gain"]), max(fitted["gain"]), len(fitted["gain"])),
            *fitted["ratio_before"],
            *fitted["ratio_after"],
            fitted["iterations"],
        )
    print(f"wrote {args.calibration}")


def _apply(args: Any) -> None:
    refuse_inputs([args.out / PREDICTION, args.out / METRICS], [args.apply, args.truth, args.calibration])
    hydro, attrs = _read(args.apply)
    true, true_attrs = _read(args.truth) if args.truth else (None, {})
    if true is not None and true.shape != hydro.shape:
        raise DataError(f"{args.truth}: true hydro {true.shape} and prediction {hydro.shape} differ")
    apply(hydro, json.loads(args.calibration.read_text()))
    claim_directory(args.out, [PREDICTION, METRICS], by="model.calibrate", beside=False, advice="choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / METRICS).unlink(missing_ok=True)  # of an earlier prediction there: never left beside this one
    with h5py.File(args.out / PREDICTION, "w") as f:
        f.create_dataset(HYDRO_DATASET, data=hydro)
        f.attrs.update(attrs)
        f.attrs["calibration"] = str(args.calibration)
    log.info("wrote %s", args.out / PREDICTION)
    if true is None:
        return
    metrics = compare(hydro, true, Normalization.from_attrs(true_attrs))
    write_text_atomically(args.out / METRICS, json.dumps(metrics | {"files": {"prediction": str(args.out)}}) + "\n")
    print(spectra_table(metrics), flush=True)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    parser = ArgumentParser(prog="python -m model.calibrate", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--fit", type=existing_file, help="prediction.h5 of model.predict on a periodic box: needs --truth"
    )
    what.add_argument("--apply", type=existing_file, help="prediction.h5 of model.predict on a periodic box")
    parser.add_argument("--calibration", type=output_file, required=True, help="the gains (JSON): --fit writes it")
    parser.add_argument("--truth", type=existing_file, help="HDF5 file with the true Hydro (--apply: metrics.json)")
    parser.add_argument("--out", type=output_dir, help="--apply: writes prediction.h5 (and metrics.json) here")
    parser.add_argument("--overwrite", action="store_true", help="--fit: replace the --calibration file")
    args = parser.parse_args(argv)
    if args.apply and not args.out:
        parser.error("--apply needs --out")
    if args.apply and not args.calibration.is_file():
        parser.error(f"--calibration {args.calibration}: no such file (--fit writes it)")
    if args.fit and (args.out or not args.truth):
        parser.error("--fit needs --truth, and --out goes with --apply")
    if args.apply and args.overwrite:
        parser.error("--overwrite goes with --fit: --apply writes into --out, which holds only this command's files")
    try:
        _fit(args) if args.fit else _apply(args)
    except (ValueError, KeyError, OSError, OutputError) as err:
        sys.exit(f"model.calibrate: {err}")


if __name__ == "__main__":
    main()
