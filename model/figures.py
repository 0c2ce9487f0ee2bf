"""Figures for people who would rather look than read: central slices, the spectra comparison, and the gas's
one-point statistics (density PDF, temperature-density plane)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from common.files import written_atomically
from model.metrics import FIELDS, VELOCITIES
from pipeline.layout import HYDRO_CHANNELS, LOG_DENSITY_SCALE, NBODY_CHANNELS


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _saved(fig: Any, path: Path) -> Path:
    """The figure written to ``path`` through a hidden temporary file, so that no half figure replaces one."""
    plt = _pyplot()
    try:
        with written_atomically(path) as tmp:
            fig.savefig(tmp, dpi=90, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path


def channel_units(name: str, temperature_log_range: float | None) -> str:
    """How a channel's values read, in the normalized units the network works in."""
    if name.endswith("density"):
        return f"log(rho) / {LOG_DENSITY_SCALE:g}, normalized"
    if name.startswith("v"):
        return f"{name}, normalized"
    if temperature_log_range:
        return f"log10(T / T0) / {temperature_log_range:g}, normalized"
    return "temperature, normalized (the file gives no scale)"


def slices(
    inputs: np.ndarray, true: np.ndarray, pred: np.ndarray, *, path: Path, temperature_log_range: float | None = None
) -> Path:
    """Central slices, a row per output channel: the matching input channel (dark-matter density or velocity; none
    for temperature), then true, predicted and predicted - true. Every colorbar names its quantity and units."""
    plt = _pyplot()
    mid = inputs.shape[1] // 2
    rows = len(HYDRO_CHANNELS)
    fig, axes = plt.subplots(rows, 4, figsize=(15, 2.9 * rows), squeeze=False)
    for row, name in enumerate(HYDRO_CHANNELS):
        units = channel_units(name, temperature_log_range)
        lo, hi = np.percentile(true[row, mid], [1, 99])
        residual = pred[row, mid] - true[row, mid]
        bound = max(abs(np.percentile(residual, 1)), abs(np.percentile(residual, 99)), 1e-6)
        source = NBODY_CHANNELS.index(name) if name in NBODY_CHANNELS else 0 if name == "gas_density" else None
        panels: list[tuple | None] = [
            None
            if source is None
            else (
                inputs[source, mid],
                f"input: dark matter {NBODY_CHANNELS[source].replace('dm_', '')}",
                "viridis",
                None,
                channel_units(NBODY_CHANNELS[source], None),
            ),
            (true[row, mid], f"true gas {name.replace('gas_', '')}", "magma", (lo, hi), units),
            (pred[row, mid], f"predicted gas {name.replace('gas_', '')}", "magma", (lo, hi), units),
            (residual, "predicted - true", "RdBu_r", (-bound, bound), f"difference in {units}"),
        ]
        for ax, panel in zip(axes[row], panels, strict=True):
            ax.set_xticks([])
            ax.set_yticks([])
            if panel is None:
                ax.set_axis_off()
                continue
            image, title, cmap, limits, label = panel
            shown = ax.imshow(
                image, cmap=cmap, origin="lower", **({} if limits is None else dict(vmin=limits[0], vmax=limits[1]))
            )
            ax.set_title(title, fontsize=9)
            fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02).set_label(label, fontsize=8)
    fig.suptitle(f"central slices (array axis 1 at {mid} of {inputs.shape[1]})", fontsize=10)
    fig.tight_layout(w_pad=2.5)
    return _saved(fig, path)


def _limits(values: list[np.ndarray], floor: float, ceiling: float, *, margin: float) -> tuple[float, float]:
    """An axis range around 1 that holds ``values`` (large and intermediate scales) and at least [floor, ceiling]."""
    finite = np.concatenate(values)
    finite = finite[np.isfinite(finite)]
    lo = min(floor, float(finite.min()) - margin) if finite.size else floor
    hi = max(ceiling, float(finite.max()) + margin) if finite.size else ceiling
    return lo, hi


def spectra(metrics: dict[str, Any], path: Path) -> Path:
    """P_pred / P_true and r(k) for the science target's fields (the velocity's components dashed), on linear axes
    scaled to the large and intermediate scales, so that deviations of a few percent show; the named k ranges are
    shaded, the target's bounds dashed, and values beyond the axis (small scales, where a smooth truth has almost no
    power) are drawn at its edge."""
    plt = _pyplot()
    ranges, target = metrics["k_ranges"], metrics["target"]
    fields = target.get("fields", FIELDS)  # metrics.json from before the velocities were judged: the two fields
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    upto = ranges.get("intermediate", ranges["large_scales"])[1]  # the k the axes are scaled to
    # Capped at 1.5 (and r at 0.5 below): a few percent stays a visible share of the axis.
    for ax, stat, floor, ceiling, cap in ((left, "power_ratio", 0.9, 1.1, 1.5), (right, "r", 0.9, 1.0, 1.05)):
        k = np.asarray(metrics[fields[0]]["k"])
        shown = [np.asarray(metrics[f][stat], dtype=float)[k <= upto] for f in fields]  # None (no truth): NaN
        lo, hi = _limits(shown, floor, ceiling, margin=0.02)
        lo, hi = max(lo, 0.5), min(hi, cap)
        for field in fields:
            values = np.asarray(metrics[field][stat], dtype=float)
            style = "--" if field in VELOCITIES else "-"
            ax.plot(k, np.clip(values, lo, hi), style, marker=".", markersize=4, label=field.replace("_", " "))
        bounds = (1 - target["power_tolerance"], 1 + target["power_tolerance"]) if stat == "power_ratio" else ()
        for y in bounds or (target["min_r"],):
            ax.axhline(y, color="firebrick", linestyle="--", lw=0.8)
        ax.axvline(target["k_max"] + 0.5, color="firebrick", linestyle="--", lw=0.8, label="science target")
        for i, (name, (k_lo, k_hi)) in enumerate(ranges.items()):
            ax.axvspan(k_lo - 0.5, k_hi + 0.5, color="0.5", alpha=0.08 * (i % 2 + 1), lw=0)
            ax.text(
                np.sqrt(max(k_lo - 0.5, 0.5) * (k_hi + 0.5)),
                lo + 0.02 * (hi - lo),
                name.replace("_", " "),
                ha="center",
                fontsize=7,
                color="0.3",
            )
        ax.axhline(1.0, color="gray", linestyle=":")
        ax.set(xscale="log", ylim=(lo, hi), xlabel="k (units of the fundamental mode 2 pi / L)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set(ylabel="P_pred(k) / P_true(k)", title="Power spectrum ratio (clipped at the axis)")
    right.set(ylabel="r(k) = P_x / sqrt(P_pred P_true)", title="Cross-correlation (clipped at the axis)")
    fig.tight_layout()
    return _saved(fig, path)


def phases(metrics: dict[str, Any], path: Path) -> Path:
    """The one-point PDF of log10 gas density, true and predicted, and the temperature-density plane of each (the
    fraction of voxels per bin, on one logarithmic colour scale), the true median relation drawn on both."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    pdf, plane, relation = (
        metrics["log_density_pdf"],
        metrics["temperature_density_plane"],
        metrics["temperature_density"],
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    centers = np.asarray(pdf["edges"])
    centers = (centers[1:] + centers[:-1]) / 2
    axes[0].plot(centers, pdf["true"], label="true", color="k")
    axes[0].plot(centers, pdf["pred"], label="predicted", color="C1", linestyle="--")
    axes[0].set(
        yscale="log",
        xlabel="log10 (gas density / mean)",
        ylabel="probability density",
        title=f"gas density PDF (L1 distance {pdf['l1_distance']:.3f})",
    )
    axes[0].legend(fontsize=8)
    x_edges, y_edges = np.asarray(plane["log10_density_edges"]), np.asarray(plane["log10_T_edges"])
    counts = [np.asarray(plane[key]) for key in ("true", "pred")]
    positive = np.concatenate([c[c > 0] for c in counts])
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    bins = np.asarray(relation["log10_density_edges"])
    median = np.array([np.nan if v is None else v for v in relation["median_log10_T_true"]], dtype=float)
    units = "log10 (T / T0)" if metrics.get("temperature_units") == "T / T0" else "temperature, normalized"
    for ax, count, title in zip(axes[1:], counts, ("true", "predicted"), strict=True):
        shown = ax.pcolormesh(x_edges, y_edges, count.T, norm=norm, cmap="magma_r")
        ax.plot((bins[1:] + bins[:-1]) / 2, median, color="C0", lw=1.2, label="true median")
        ax.set(xlabel="log10 (gas density / mean)", ylabel=units, title=f"temperature-density plane, {title}")
        ax.legend(fontsize=8, loc="upper left")
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02).set_label("fraction of voxels", fontsize=8)
    fig.tight_layout()
    return _saved(fig, path)
