"""The statistics cosmologists check first, comparing a predicted hydro box with the true one: L1 per channel; for gas
density and temperature in physical units the power spectrum ratio and the cross-correlation r(k) per shell of |k|,
with medians over named k ranges and the science target; the density PDF; the temperature-density relation; the
gas velocities' spectra, judged apart (``velocity_target``). docs/prediction.md defines each one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.layout import HYDRO_CHANNELS, LOG_DENSITY_SCALE


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

    def density(self, x: np.ndarray) -> np.ndarray:
        return np.exp(LOG_DENSITY_SCALE * x.astype(np.float64))

    def temperature(self, x: np.ndarray) -> np.ndarray:
        """T / T0 where the normalization is known, else the normalized values themselves."""
        x = x.astype(np.float64)
        return 10.0 ** (self.temperature_log_range * x) if self.temperature_log_range else x


def _shells(n: int) -> tuple[np.ndarray, int]:
    """|k| of every rfft mode of an n^3 grid, in units of the fundamental mode, rounded to shells."""
    k = np.fft.fftfreq(n) * n
    kz = np.fft.rfftfreq(n) * n
    kmag = np.sqrt(k[:, None, None] ** 2 + k[None, :, None] ** 2 + kz[None, None, :] ** 2)
    return np.rint(kmag).astype(np.int64), n // 2


def _modes(field: np.ndarray) -> np.ndarray:
    return np.fft.rfftn(field, axes=(0, 1, 2)) / field.size


def spectra(a: np.ndarray, b: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Shell-averaged P_a(k) (and P_b, the cross spectrum P_ab) for k = 1 .. L/2, per mode.

    The rfft holds half the modes: those of the kz = 0 and Nyquist planes are counted once, the
    others stand for themselves and their conjugates, which have the same power.
    """
    n = a.shape[0]
    shells, nyquist = _shells(n)
    weight = np.full(shells.shape, 2.0)
    weight[..., 0] = 1.0
    if n % 2 == 0:
        weight[..., -1] = 1.0
    fa = _modes(a)
    spectra_in = {"p_a": np.abs(fa) ** 2}
    if b is not None:
        fb = _modes(b)
        spectra_in |= {"p_b": np.abs(fb) ** 2, "p_ab": (fa * np.conj(fb)).real}
    counts = np.bincount(shells.ravel(), weights=weight.ravel(), minlength=nyquist + 1)
    out = {"k": np.arange(1, nyquist + 1), "modes": counts[1 : nyquist + 1]}
    for name, power in spectra_in.items():
        # the grid's variance of f is the sum of |f_k|^2 over all modes; per mode, P = n^3 |f_k|^2
        total = np.bincount(shells.ravel(), weights=(power * weight).ravel(), minlength=nyquist + 1)
        out[name] = (total[1 : nyquist + 1] / counts[1 : nyquist + 1]) * a.size
    return out


def contrast(field: np.ndarray) -> np.ndarray:
    return field / field.mean() - 1.0


# Shells where the truth's power is below this fraction of its peak are beyond the truth's own cut-off (a field
# smoothed by construction): there the ratio measures the prediction's noise over nothing, not the model.
TRUTH_CUTOFF = 1e-6
FIELDS = ("gas_density", "temperature")  # the fields of the science target
VELOCITIES = ("vx", "vy", "vz", "speed")  # the gas velocity's components (normalized units) and its magnitude


def compare_spectra(pred: np.ndarray, true: np.ndarray, *, of_contrast: bool = True) -> dict[str, Any]:
    """P_pred / P_true and r(k) per shell, and the last k before the truth's cut-off (None where it has none): of
    the fields' contrasts, or of the fields themselves."""
    s = spectra(contrast(pred), contrast(true)) if of_contrast else spectra(pred, true)
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


def compare(pred: np.ndarray, true: np.ndarray, norm: Normalization, *, bins: int = 40) -> dict[str, Any]:
    """All the statistics for a predicted (5, L, L, L) hydro box against the true one (normalized units)."""
    l1 = {name: float(np.abs(pred[c].astype(np.float64) - true[c]).mean()) for c, name in enumerate(HYDRO_CHANNELS)}
    rho_pred, rho_true = norm.density(pred[0]), norm.density(true[0])
    t_pred, t_true = norm.temperature(pred[4]), norm.temperature(true[4])
    result: dict[str, Any] = {
        "l1": l1,
        "l1_mean": float(np.mean(list(l1.values()))),
        "temperature_units": "T / T0"
        if norm.temperature_log_range
        else "normalized (the data file gives no normalization)",
        "gas_density": compare_spectra(rho_pred, rho_true),
        "temperature": compare_spectra(t_pred, t_true),
    }
    velocity = {which: box[1:4].astype(np.float64) for which, box in (("pred", pred), ("true", true))}
    for c, name in enumerate(VELOCITIES[:3]):
        result[name] = compare_spectra(velocity["pred"][c], velocity["true"][c], of_contrast=False)
    speed = {which: np.sqrt(np.square(v).sum(axis=0)) for which, v in velocity.items()}
    result["speed"] = compare_spectra(speed["pred"], speed["true"], of_contrast=False)
    log_true, log_pred = np.log10(rho_true), np.log10(rho_pred)
    edges = np.linspace(*np.percentile(log_true, [0.1, 99.9]), bins + 1)
    pdf_true, _ = np.histogram(log_true, edges, density=True)
    pdf_pred, _ = np.histogram(log_pred, edges, density=True)
    result["log_density_pdf"] = {
        "edges": edges.tolist(),
        "true": pdf_true.tolist(),
        "pred": pdf_pred.tolist(),
        "l1_distance": float(np.abs(pdf_pred - pdf_true).sum() * (edges[1] - edges[0])),
    }
    to_log = np.log10 if norm.temperature_log_range else np.asarray  # normalized T is already logarithmic
    log_t_true, log_t_pred = to_log(t_true), to_log(t_pred)
    edges = np.linspace(*np.percentile(log_true, [1, 99]), bins // 2 + 1)
    which = np.digitize(log_true.ravel(), edges) - 1
    which_pred = np.digitize(log_pred.ravel(), edges) - 1
    medians = {"true": [], "pred": []}
    for i in range(len(edges) - 1):
        for key, index, values in (("true", which, log_t_true), ("pred", which_pred, log_t_pred)):
            selected = values.ravel()[index == i]
            medians[key].append(float(np.median(selected)) if selected.size else None)
    result["temperature_density"] = {
        "log10_density_edges": edges.tolist(),
        "median_log10_T_true": medians["true"],
        "median_log10_T_pred": medians["pred"],
    }
    result["temperature_density_plane"] = _plane(log_true, log_t_true, log_pred, log_t_pred=log_t_pred, bins=bins)
    ranges = k_ranges(len(result["gas_density"]["k"]))
    result["k_ranges"] = {name: [lo, hi] for name, (lo, hi) in ranges.items()}
    result["target"] = science_target(result, FIELDS)
    result["velocity_target"] = science_target(result, VELOCITIES)
    result["summary"] = {}
    for field in (*FIELDS, *VELOCITIES):
        last = _last_resolved(result[field])  # shells beyond the truth's cut-off: out
        for stat in ("power_ratio", "r"):
            for name, (lo, hi) in ranges.items():
                values = [v for v in result[field][stat][lo - 1 : min(hi, last)] if v is not None]
                result["summary"][f"{field}_{stat}_{name}"] = float(np.median(values)) if values else None
    return result


def _last_resolved(spectra: dict[str, Any]) -> int:
    """The last k the truth resolves (0: none)."""
    cutoff = spectra["truth_cutoff_k"]
    return len(spectra["k"]) if cutoff is None else cutoff


def _plane(log_rho: np.ndarray, log_t: np.ndarray, log_rho_pred: np.ndarray, *, log_t_pred: np.ndarray, bins: int):
    """2D histograms (fraction of voxels) of log10 T against log10 density, true and predicted, on the truth's
    ranges (0.1 to 99.9 percentiles), for the temperature-density figure."""
    rho_edges = np.linspace(*np.percentile(log_rho, [0.1, 99.9]), bins + 1)
    t_edges = np.linspace(*np.percentile(log_t, [0.1, 99.9]), bins + 1)
    planes = {}
    for key, x, y in (("true", log_rho, log_t), ("pred", log_rho_pred, log_t_pred)):
        counts, _, _ = np.histogram2d(x.ravel(), y.ravel(), bins=(rho_edges, t_edges))
        planes[key] = (counts / x.size).tolist()
    return {"log10_density_edges": rho_edges.tolist(), "log10_T_edges": t_edges.tolist(), **planes}


# The science target: on the validation box, for k up to a quarter of Nyquist, power within 10% and r >= 0.95.
TARGET_POWER_TOLERANCE = 0.10
TARGET_MIN_R = 0.95


def science_target(metrics: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """Per field, over every shell from k = 1 to a quarter of Nyquist (and not beyond the truth's cut-off): the
    lowest and highest power ratio, the lowest r, and whether all are within the target."""
    nyquist = len(metrics["gas_density"]["k"])
    upto = max(1, nyquist // 4)
    target: dict[str, Any] = {"k_max": upto, "power_tolerance": TARGET_POWER_TOLERANCE, "min_r": TARGET_MIN_R}
    for field in fields:
        last = min(upto, _last_resolved(metrics[field]))
        ratio, r = metrics[field]["power_ratio"][:last], metrics[field]["r"][:last]
        if not ratio:  # a truth without fluctuations (a file whose velocities are all zero): nothing to judge
            target[field] = {"power_ratio_min": None, "power_ratio_max": None, "r_min": None, "met": None}
            continue
        met = all(abs(x - 1) <= TARGET_POWER_TOLERANCE for x in ratio) and min(r) >= TARGET_MIN_R
        target[field] = {"power_ratio_min": min(ratio), "power_ratio_max": max(ratio), "r_min": min(r), "met": met}
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


def spectra_table(metrics: dict[str, Any], max_rows: int = 32) -> str:
    """P_pred / P_true and r(k) per k for gas density and temperature, then the medians over the named ranges.
    Boxes with more than ``max_rows`` shells show log-spaced k (metrics.json holds every k)."""
    k = metrics["gas_density"]["k"]
    shown = (
        range(len(k)) if len(k) <= max_rows else sorted({int(round(i)) for i in np.geomspace(1, len(k), max_rows) - 1})
    )
    lines = [f"{'k':>5}  {'gas density P/P':>15}  {'r':>6}  {'temperature P/P':>15}  {'r':>6}"]
    for i in shown:
        row = [_shown(metrics[f][stat][i]) for f in FIELDS for stat in ("power_ratio", "r")]
        lines.append(f"{k[i]:>5}  {row[0]:>15}  {row[1]:>6}  {row[2]:>15}  {row[3]:>6}")
    if len(shown) < len(k):
        lines.append(f"({len(shown)} of {len(k)} shells shown; metrics.json holds every k)")
    cuts = [
        f"{f.replace('_', ' ')} from k {metrics[f]['truth_cutoff_k'] + 1}"
        for f in FIELDS
        if metrics[f]["truth_cutoff_k"] is not None
    ]
    if cuts:
        lines.append(f"(left out of the medians, beyond the truth's cut-off: {', '.join(cuts)})")
    lines.append("medians over k ranges (units of the fundamental mode 2 pi / L):")

    def medians(field: str, k_range: str) -> str:
        values = [metrics["summary"][f"{field}_{stat}_{k_range}"] for stat in ("power_ratio", "r")]
        return "P/P {}, r {}".format(*map(_shown, values))

    for name, (lo, hi) in metrics["k_ranges"].items():
        label = f"{name.replace('_', ' ')} (k {lo}-{hi})"
        cells = [f"{f.replace('_', ' ')} {medians(f, name)}" for f in FIELDS]
        lines.append(f"  {label:<28} {'; '.join(cells)}")
    lines += _target_lines(metrics["target"], FIELDS, "science target")
    lines.append("gas velocities (of the field itself, not a contrast), medians over the same k ranges:")
    for name, (lo, hi) in metrics["k_ranges"].items():
        label = f"{name.replace('_', ' ')} (k {lo}-{hi})"
        cells = [f"{v} {medians(v, name)}" for v in VELOCITIES]
        lines.append(f"  {label:<28} {'; '.join(cells)}")
    lines += _target_lines(metrics["velocity_target"], VELOCITIES, "velocities, apart from the science target")
    return "\n".join(lines)


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _target_lines(target: dict[str, Any], fields: tuple[str, ...], title: str) -> list[str]:
    lines = [
        f"{title}, every shell k 1-{target['k_max']}: P/P within {target['power_tolerance']:.0%}, "
        f"r >= {target['min_r']}:"
    ]
    for f in fields:
        t = target[f]
        if t["met"] is None:
            lines.append(f"  {f.replace('_', ' '):<12} no fluctuations in the truth: not judged")
            continue
        lines.append(
            f"  {f.replace('_', ' '):<12} P/P {t['power_ratio_min']:.3f}-{t['power_ratio_max']:.3f}, "
            f"r >= {t['r_min']:.3f}: {'met' if t['met'] else 'not met'}"
        )
    return lines
