"""Figures for people who would rather look than read: central slices and the spectra comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.layout import HYDRO_CHANNELS


def slices(inputs: np.ndarray, true: np.ndarray, pred: np.ndarray, path: Path) -> Path:
    """Central slices: the input dark-matter density, then true, predicted and residual for each output channel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mid = inputs.shape[1] // 2
    fig, axes = plt.subplots(len(HYDRO_CHANNELS), 4, figsize=(11, 2.6 * len(HYDRO_CHANNELS)), squeeze=False)
    for row, name in enumerate(HYDRO_CHANNELS):
        lo, hi = np.percentile(true[row, mid], [1, 99])
        residual = pred[row, mid] - true[row, mid]
        bound = max(abs(np.percentile(residual, 1)), abs(np.percentile(residual, 99)), 1e-6)
        panels = [
            (inputs[0, mid], "input: dark-matter density", "viridis", None),
            (true[row, mid], f"true {name}", "magma", (lo, hi)),
            (pred[row, mid], f"predicted {name}", "magma", (lo, hi)),
            (residual, "predicted - true", "RdBu_r", (-bound, bound)),
        ]
        for ax, (image, title, cmap, limits) in zip(axes[row], panels):
            shown = ax.imshow(image, cmap=cmap, origin="lower", **({} if limits is None else dict(vmin=limits[0], vmax=limits[1])))
            ax.set_title(title, fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def spectra(metrics: dict[str, Any], path: Path) -> Path:
    """P_pred / P_true and r(k) for gas density and temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for field in ("gas_density", "temperature"):
        k = metrics[field]["k"]
        left.plot(k, metrics[field]["power_ratio"], marker=".", label=field.replace("_", " "))
        right.plot(k, metrics[field]["r"], marker=".", label=field.replace("_", " "))
    left.axhline(1.0, color="gray", linestyle=":")
    right.axhline(1.0, color="gray", linestyle=":")
    # log y: where the truth is smooth its power falls towards zero and the ratio can grow by decades
    left.set(xscale="log", yscale="log", xlabel="k (units of the fundamental mode 2 pi / L)", ylabel="P_pred / P_true",
             title="Power spectrum ratio")  # fmt: skip
    right.set(xscale="log", xlabel="k (units of the fundamental mode 2 pi / L)", ylabel="r(k)", title="Cross-correlation",
              ylim=(min(0.0, min(min(metrics[f]["r"]) for f in ("gas_density", "temperature"))), 1.05))  # fmt: skip
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
