"""The metrics said in words: the table ``model.predict`` prints, with the spectra per k, their medians over named
ranges and the science target's verdicts; for a box that is not periodic, L1 by distance from its faces instead."""

from __future__ import annotations

from typing import Any

import numpy as np

from model.metrics import FIELDS, VELOCITIES


def spectra_table(metrics: dict[str, Any], max_rows: int = 32) -> str:
    """P_pred / P_true and r(k) per k for gas density and temperature, then the medians over the named ranges.
    Boxes with more than ``max_rows`` shells show log-spaced k (metrics.json holds every k)."""
    if "edges" in metrics:
        return _edge_lines(metrics)
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
    lines.append("gas velocities (of the field itself, not a contrast), medians over the same k ranges:")
    for name, (lo, hi) in metrics["k_ranges"].items():
        label = f"{name.replace('_', ' ')} (k {lo}-{hi})"
        cells = [f"{v} {medians(v, name)}" for v in VELOCITIES]
        lines.append(f"  {label:<28} {'; '.join(cells)}")
    return "\n".join(lines + _target_lines(metrics["target"]))


def _edge_lines(metrics: dict[str, Any]) -> str:
    """What a box that is not periodic gets instead of the spectra: L1 by distance from its faces."""
    edges = metrics["edges"]
    shown = [i for i, d in enumerate(edges["distance"]) if d < 16 or d == edges["distance"][-1]]
    cells = ", ".join(f"{edges['distance'][i]}: {edges['l1_mean'][i]:.4f}" for i in shown)
    lines = [f"spectra, r(k) and the science target {metrics['spectra']}", f"L1 by voxels from the faces: {cells}"]
    if "margin" in metrics:
        margin = metrics["margin"]
        lines.append(f"margin: {margin['voxels']} voxels from a face ({margin['rule']})")
    return "\n".join(lines)


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _target_lines(target: dict[str, Any]) -> list[str]:
    """The science target's verdict per field, the speed's figures beside them, and the verdict of all."""
    lines = [
        f"science target, every shell k 1-{target['k_max']}: P/P within {target['power_tolerance']:.0%}, "
        f"r >= {target['min_r']}:"
    ]
    for f in (*target["fields"], "speed"):
        t = target[f]
        if t["met"] is None:
            lines.append(f"  {f.replace('_', ' '):<12} no fluctuations in the truth: not judged")
            continue
        verdict = ("met" if t["met"] else "not met") if t["judged"] else "reported, not judged"
        lines.append(
            f"  {f.replace('_', ' '):<12} P/P {t['power_ratio_min']:.3f}-{t['power_ratio_max']:.3f}, "
            f"r >= {t['r_min']:.3f}: {verdict}"
        )
    missed = [f.replace("_", " ") for f in target["fields"] if target[f]["met"] is False]
    unjudged = "" if all(target[f]["met"] is not None for f in target["fields"]) else " judged"
    if target["met"] is None:
        lines.append("science target: no field to judge (the truth has no fluctuations)")
    else:
        lines.append(
            f"science target not met by {', '.join(missed)}"
            if missed
            else f"science target met by every{unjudged} field"
        )
    return lines
