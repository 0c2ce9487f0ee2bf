"""The statistics cosmologists check first, comparing a predicted hydro box with the true one: L1 per channel; for gas
density and temperature in physical units the power spectrum ratio and the cross-correlation r(k) per shell of |k|,
with medians over named k ranges; the same for the gas velocity's components and its speed; the science target,
one verdict per field; the density PDF; the temperature-density relation. Boxes of any shape L1 x L2 x L3; where
one is not periodic, the spectra are not applicable and L1 is given by distance from its faces instead.
docs/prediction.md defines each one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.fft

from pipeline.layout import GAS_DENSITY, HYDRO_CHANNELS, LOG_DENSITY_SCALE, TEMPERATURE, density, temperature


@dataclass(frozen=True)
class Normalization:
    """How the targets were normalized: density as log(rho) / 14; temperature as log10(T / T0) / range."""

    temperature_log_range: float | None  # None: the file does not say, temperature stays normalized

    @classmethod
    def from_attrs(cls, attrs: Any) -> Normalization:
        spec = attrs.get("spec")
        if spec is None:
            return cls(None)
        return cls(json.loads(spec).get("temperature_log_range"))


def _wavenumbers(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k along each axis of an rfft of a grid of ``shape``, in units of the fundamental mode of its shortest side
    (2 pi / L_min: the shells' width, so that every shell has modes along every axis)."""
    n_min = min(shape)
    return np.fft.fftfreq(shape[0]) * n_min, np.fft.fftfreq(shape[1]) * n_min, np.fft.rfftfreq(shape[2]) * n_min


def _shells(shape: int | tuple[int, int, int]) -> tuple[np.ndarray, int]:
    """|k| of every rfft mode of a grid (n^3, or of ``shape``), rounded to shells, and the last shell (Nyquist)."""
    kx, ky, kz = _wavenumbers((shape,) * 3 if isinstance(shape, int) else shape)
    kmag = np.sqrt(kx[:, None, None] ** 2 + ky[None, :, None] ** 2 + kz[None, None, :] ** 2)
    return np.rint(kmag).astype(np.int64), min((shape,) if isinstance(shape, int) else shape) // 2


def _rfft(field: np.ndarray) -> np.ndarray:
    """The field's rfft in single precision (complex64: half the memory of numpy's), the field consumed."""
    return scipy.fft.rfftn(field, workers=FFT_WORKERS, overwrite_x=True)


def _shell_sums(transforms: list[np.ndarray], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Per shell of |k|, summed plane by plane of the transforms (no grid of the box's size besides them): the mode
    counts and, in float64, |f_a|^2 (and |f_b|^2 and Re f_a f_b*) for one (two) transforms of a grid of ``shape``.
    The rfft holds half the modes: those of the kz = 0 and Nyquist planes are counted once, the others for their
    conjugates too."""
    nyquist = min(shape) // 2
    kx, k, kz = _wavenumbers(shape)
    weight = np.full(kz.shape, 2.0)
    weight[0] = 1.0
    if shape[2] % 2 == 0:
        weight[-1] = 1.0
    names = ["p_a"] if len(transforms) == 1 else ["p_a", "p_b", "p_ab"]
    sums = {name: np.zeros(nyquist + 1) for name in ["modes", *names]}
    for i in range(shape[0]):
        shells = np.rint(np.sqrt(kx[i] ** 2 + k[:, None] ** 2 + kz[None, :] ** 2)).astype(np.int64).ravel()
        inside = shells <= nyquist
        shells, plane_weight = shells[inside], np.broadcast_to(weight, (k.size, kz.size)).ravel()[inside]
        planes = [t[i].ravel()[inside] for t in transforms]
        powers = {"p_a": np.abs(planes[0]) ** 2}
        if len(planes) == 2:
            powers |= {"p_b": np.abs(planes[1]) ** 2, "p_ab": (planes[0] * np.conj(planes[1])).real}
        sums["modes"] += np.bincount(shells, weights=plane_weight, minlength=nyquist + 1)
        for name, power in powers.items():
            sums[name] += np.bincount(shells, weights=power.astype(np.float64) * plane_weight, minlength=nyquist + 1)
    return sums


def _spectra_of(transforms: list[np.ndarray], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    sums = _shell_sums(transforms, shape)
    counts, size = sums.pop("modes")[1:], int(np.prod(shape))
    # the grid's variance of f is the sum of |f_k / size|^2 over all modes; per mode, P = size |f_k / size|^2
    return {"k": np.arange(1, counts.size + 1), "modes": counts, **{n: v[1:] / counts / size for n, v in sums.items()}}


def spectra(a: np.ndarray, b: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Shell-averaged P_a(k) (and P_b, the cross spectrum P_ab) for k = 1 .. L/2, per mode, of fields in memory, in
    double precision."""
    fields = [a] if b is None else [a, b]
    return _spectra_of([np.fft.rfftn(np.asarray(f, dtype=np.float64)) for f in fields], a.shape)


def contrast(field: np.ndarray) -> np.ndarray:
    return field / field.mean() - 1.0


# Shells where the truth's power is below this fraction of its peak are beyond the truth's own cut-off (a field
# smoothed by construction): there the ratio measures the prediction's noise over nothing, not the model.
TRUTH_CUTOFF = 1e-6
FIELDS = ("gas_density", "temperature")  # the scalar fields, spectra of their contrast in physical units
VELOCITIES = ("vx", "vy", "vz", "speed")  # the gas velocity's components (normalized units) and its magnitude
JUDGED = (*FIELDS, *VELOCITIES[:3])  # the science target's fields; the speed is reported beside them
FFT_WORKERS = max(1, len(os.sched_getaffinity(0)))


def _ratios(s: dict[str, np.ndarray]) -> dict[str, Any]:
    """P_pred / P_true and r(k) per shell, and the last k before the truth's cut-off (None where it has none)."""
    resolved = s["p_b"] > TRUTH_CUTOFF * s["p_b"].max()  # none where the truth has no fluctuations at all
    cut = np.flatnonzero(~resolved)
    with np.errstate(divide="ignore", invalid="ignore"):  # shells where the truth has no power: None
        ratio, r = s["p_a"] / s["p_b"], s["p_ab"] / np.sqrt(s["p_a"] * s["p_b"])
    return {
        "k": s["k"].tolist(),
        "power_ratio": _finite(ratio),
        "r": _finite(r),
        "truth_cutoff_k": int(cut[0]) if cut.size else None,  # shells are k = 1, 2, ...: the last one before
    }


def _finite(values: np.ndarray) -> list[float | None]:
    return [float(v) if np.isfinite(v) else None for v in values]


class _Boxes:
    """A predicted and a true (5, L1, L2, L3) box (arrays, memory maps or HDF5 datasets) read a slab of planes at a
    time, so that only the fields a statistic needs whole are ever whole, in float32."""

    def __init__(self, pred: Any, true: Any, norm: Normalization) -> None:
        self.boxes, self.norm = {"pred": pred, "true": true}, norm
        self.shape = tuple(int(n) for n in true.shape[1:])
        self.voxels = int(np.prod(self.shape))
        plane = self.shape[1] * self.shape[2]
        self.step = max(1, min(2**22 // plane, self.shape[0] // 16))  # a sixteenth of the box, 16 MiB at most

    def slabs(self) -> Iterator[slice]:
        for x in range(0, self.shape[0], self.step):
            yield slice(x, min(x + self.step, self.shape[0]))

    def read(self, which: str, channels: slice | int, planes: slice) -> np.ndarray:
        return np.asarray(self.boxes[which][channels, planes], dtype=np.float32)

    def field(self, which: str, make: Callable[[Callable[[Any], np.ndarray]], np.ndarray]) -> np.ndarray:
        """A (L, L, L) float32 field made slab by slab: ``make(read)`` from ``read(channels)`` of one slab."""
        out = np.empty(self.shape, dtype=np.float32)
        for planes in self.slabs():
            out[planes] = make(lambda channels, p=planes: self.read(which, channels, p))
        return out

    def spectra(
        self, make: Callable[[Callable[[Any], np.ndarray]], np.ndarray], *, of_contrast: bool
    ) -> dict[str, Any]:
        """``_ratios`` of a field of the prediction and the truth, made by ``make``, one whole field at a time."""
        transforms = []
        for which in ("pred", "true"):
            field = self.field(which, make)
            if of_contrast:
                field /= np.float32(field.mean(dtype=np.float64))
                field -= 1
            transforms.append(_rfft(field))
            del field
        return _ratios(_spectra_of(transforms, self.shape))


def _density(norm: Normalization) -> Callable[[Callable[[Any], np.ndarray]], np.ndarray]:
    return lambda read: density(read(GAS_DENSITY))


def _temperature(norm: Normalization) -> Callable[[Callable[[Any], np.ndarray]], np.ndarray]:
    """T / T0 where the normalization is known, else the normalized values themselves."""
    if not norm.temperature_log_range:
        return lambda read: read(TEMPERATURE)
    return lambda read: temperature(read(TEMPERATURE), norm.temperature_log_range)


def _log_density(read: Callable[[Any], np.ndarray]) -> np.ndarray:
    return read(GAS_DENSITY) * np.float32(LOG_DENSITY_SCALE / np.log(10))  # log10 of exp(14 x)


def _log_temperature(norm: Normalization) -> Callable[[Callable[[Any], np.ndarray]], np.ndarray]:
    scale = np.float32(norm.temperature_log_range or 1)  # normalized T is already logarithmic
    return lambda read: read(TEMPERATURE) * scale


def compare(
    pred: Any, true: Any, norm: Normalization, *, bins: int = 40, periodic: tuple[bool, ...] = (True, True, True)
) -> dict[str, Any]:
    """All the statistics for a predicted (5, L1, L2, L3) hydro box against the true one (normalized units), read a
    slab at a time: at most three fields of the box in float32 at once, whatever their storage. Along an axis that
    is not ``periodic`` the spectra do not apply: L1 by distance from the faces (``edges``) is given instead."""
    boxes = _Boxes(pred, true, norm)
    totals = np.zeros(len(HYDRO_CHANNELS))
    edges = _FaceDistances(boxes.shape, periodic)
    for planes in boxes.slabs():
        diff = np.abs(
            boxes.read("pred", slice(None), planes).astype(np.float64) - boxes.read("true", slice(None), planes)
        )
        totals += diff.reshape(len(HYDRO_CHANNELS), -1).sum(axis=1)
        edges.add(diff, planes)
    l1 = {name: float(totals[c] / boxes.voxels) for c, name in enumerate(HYDRO_CHANNELS)}
    result: dict[str, Any] = {
        "l1": l1,
        "l1_mean": float(np.mean(list(l1.values()))),
        "temperature_units": "T / T0"
        if norm.temperature_log_range
        else "normalized (the data file gives no normalization)",
    }
    if not all(periodic):
        return result | _one_point(boxes, norm, bins=bins) | {"periodic": list(periodic), **edges.result()}
    result["gas_density"] = boxes.spectra(_density(norm), of_contrast=True)
    result["temperature"] = boxes.spectra(_temperature(norm), of_contrast=True)
    for c, name in enumerate(VELOCITIES[:3], start=1):
        result[name] = boxes.spectra(lambda read, c=c: read(c), of_contrast=False)
    speed = lambda read: np.sqrt(np.square(read(slice(1, 4))).sum(axis=0))  # noqa: E731
    result["speed"] = boxes.spectra(speed, of_contrast=False)
    result |= _one_point(boxes, norm, bins=bins)
    ranges = k_ranges(len(result["gas_density"]["k"]))
    result["k_ranges"] = {name: [lo, hi] for name, (lo, hi) in ranges.items()}
    result["target"] = science_target(result)
    result["summary"] = {}
    for field in (*FIELDS, *VELOCITIES):
        last = _last_resolved(result[field])  # shells beyond the truth's cut-off: out
        for stat in ("power_ratio", "r"):
            for name, (lo, hi) in ranges.items():
                values = [v for v in result[field][stat][lo - 1 : min(hi, last)] if v is not None]
                result["summary"][f"{field}_{stat}_{name}"] = float(np.median(values)) if values else None
    return result


NOT_PERIODIC = "not applicable: the box is not periodic along every axis (a spectrum would see its faces as a jump)"


class _FaceDistances:
    """L1 summed by a voxel's distance from the nearest face along the axes that are not periodic (0: on the face)."""

    def __init__(self, shape: tuple[int, ...], periodic: tuple[bool, ...]) -> None:
        self.open = [not p for p in periodic]
        far = max(shape)  # a periodic axis is never the nearest
        self.along = [
            np.minimum(np.arange(n), np.arange(n)[::-1]) if o else np.full(n, far)
            for n, o in zip(shape, self.open, strict=True)
        ]
        self.sums, self.counts = np.zeros((len(HYDRO_CHANNELS), far + 1)), np.zeros(far + 1)

    def add(self, diff: np.ndarray, planes: slice) -> None:
        if not any(self.open):
            return
        x, y, z = self.along[0][planes], self.along[1], self.along[2]
        distance = np.minimum(np.minimum(x[:, None, None], y[None, :, None]), z[None, None, :]).ravel()
        self.counts += np.bincount(distance, minlength=self.counts.size)
        for c in range(diff.shape[0]):
            self.sums[c] += np.bincount(distance, weights=diff[c].ravel(), minlength=self.counts.size)

    def result(self) -> dict[str, Any]:
        found = np.flatnonzero(self.counts)
        l1 = self.sums[:, found] / self.counts[found]
        return {
            "spectra": NOT_PERIODIC,
            "edges": {
                "distance": found.tolist(),
                "voxels": self.counts[found].astype(int).tolist(),
                "l1_mean": l1.mean(axis=0).tolist(),
                "l1": {name: l1[c].tolist() for c, name in enumerate(HYDRO_CHANNELS)},
            },
        }


def _one_point(boxes: _Boxes, norm: Normalization, *, bins: int) -> dict[str, Any]:
    """The density PDF, the temperature-density relation and its plane, on edges from the truth's percentiles."""
    log_t_of = _log_temperature(norm)
    log_rho = boxes.field("true", _log_density)
    rho_cuts = np.percentile(log_rho, [0.1, 1, 99, 99.9])
    log_t = boxes.field("true", log_t_of)
    t_cuts = np.percentile(log_t, [0.1, 99.9])
    del log_t
    pdf_edges = np.linspace(rho_cuts[0], rho_cuts[3], bins + 1)
    relation_edges = np.linspace(rho_cuts[1], rho_cuts[2], bins // 2 + 1)
    plane_edges = (pdf_edges, np.linspace(t_cuts[0], t_cuts[1], bins + 1))
    counts = {"true": np.zeros(bins), "pred": np.zeros(bins)}
    planes = {"true": np.zeros((bins, bins)), "pred": np.zeros((bins, bins))}
    medians: dict[str, list[float | None]] = {}
    for which in ("true", "pred"):
        log_rho = log_rho if which == "true" else boxes.field("pred", _log_density)
        counts[which] += np.histogram(log_rho, pdf_edges)[0]
        bin_of = (np.digitize(log_rho, relation_edges) - 1).astype(np.int16)
        del log_rho
        log_t = boxes.field(which, log_t_of)
        medians[which] = [_median(log_t[bin_of == i]) for i in range(len(relation_edges) - 1)]
        del bin_of
        for planes_ in boxes.slabs():
            rho_slab = _log_density(lambda channels, p=planes_, w=which: boxes.read(w, channels, p))
            planes[which] += np.histogram2d(rho_slab.ravel(), log_t[planes_].ravel(), bins=plane_edges)[0]
        del log_t
    width = pdf_edges[1] - pdf_edges[0]
    pdf = {which: c / c.sum() / width for which, c in counts.items()}
    return {
        "log_density_pdf": {
            "edges": pdf_edges.tolist(),
            "true": pdf["true"].tolist(),
            "pred": pdf["pred"].tolist(),
            "l1_distance": float(np.abs(pdf["pred"] - pdf["true"]).sum() * width),
        },
        "temperature_density": {
            "log10_density_edges": relation_edges.tolist(),
            "median_log10_T_true": medians["true"],
            "median_log10_T_pred": medians["pred"],
        },
        "temperature_density_plane": {
            "log10_density_edges": plane_edges[0].tolist(),
            "log10_T_edges": plane_edges[1].tolist(),
            **{which: (p / boxes.voxels).tolist() for which, p in planes.items()},
        },
    }


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values.astype(np.float64), overwrite_input=True)) if values.size else None


def _last_resolved(spectra: dict[str, Any]) -> int:
    """The last k the truth resolves (0: none)."""
    cutoff = spectra["truth_cutoff_k"]
    return len(spectra["k"]) if cutoff is None else cutoff


# The science target: on the validation box, for k up to a quarter of Nyquist, power within 10% and r >= 0.95.
TARGET_POWER_TOLERANCE = 0.10
TARGET_MIN_R = 0.95


def science_target(metrics: dict[str, Any]) -> dict[str, Any]:
    """Per field, over every shell from k = 1 to a quarter of Nyquist (and not beyond the truth's cut-off): the
    lowest and highest power ratio, the lowest r, and whether all are within the target (``met``; None where the
    truth has no fluctuations); the speed's the same, reported but not judged. ``met`` at the top: every field's."""
    nyquist = len(metrics["gas_density"]["k"])
    upto = max(1, nyquist // 4)
    target: dict[str, Any] = {"k_max": upto, "power_tolerance": TARGET_POWER_TOLERANCE, "min_r": TARGET_MIN_R}
    for field in (*JUDGED, "speed"):
        last = min(upto, _last_resolved(metrics[field]))
        ratio, r = metrics[field]["power_ratio"][:last], metrics[field]["r"][:last]
        if not ratio:  # a truth without fluctuations (a file whose velocities are all zero): nothing to judge
            stats: dict[str, Any] = {"power_ratio_min": None, "power_ratio_max": None, "r_min": None, "met": None}
        else:
            met = all(abs(x - 1) <= TARGET_POWER_TOLERANCE for x in ratio) and min(r) >= TARGET_MIN_R
            stats = {"power_ratio_min": min(ratio), "power_ratio_max": max(ratio), "r_min": min(r), "met": met}
        target[field] = stats | {"judged": field in JUDGED}
    target["fields"] = list(JUDGED)
    verdicts = [target[f]["met"] for f in JUDGED if target[f]["met"] is not None]
    target["met"] = all(verdicts) if verdicts else None
    return target


def k_ranges(nyquist: int) -> dict[str, tuple[int, int]]:
    """The named ranges of k (inclusive, in units of the fundamental mode) that the summaries cover: large scales
    up to an eighth of the Nyquist mode, intermediate up to half of it, small scales up to Nyquist."""
    large = max(1, nyquist // 8)
    intermediate = min(nyquist, max(large + 1, nyquist // 2))
    ranges = {
        "large_scales": (1, large),
        "intermediate": (large + 1, intermediate),
        "small_scales": (intermediate + 1, nyquist),
    }
    return {name: (lo, hi) for name, (lo, hi) in ranges.items() if lo <= hi}


def edge_margin(edges: dict[str, Any], *, interior_from: int, tolerance: float = 0.1) -> int | None:
    """The voxels from the faces within which L1 exceeds the interior's (the voxels ``interior_from`` or more from
    every face) by more than ``tolerance``; None where the box has no such interior."""
    distance, voxels, l1 = (np.asarray(edges[k]) for k in ("distance", "voxels", "l1_mean"))
    inside = distance >= interior_from
    if not inside.any():
        return None
    interior = float((l1[inside] * voxels[inside]).sum() / voxels[inside].sum())
    worse = distance[~inside & (l1 > (1 + tolerance) * interior)]
    return int(worse.max()) + 1 if worse.size else 0
