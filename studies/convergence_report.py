"""The convergence study's results: per global batch and rule, the optimizer steps and samples to reach the base run's
final validation loss (and within 5% of it); the fit of McCandlish et al.'s S(B) = S_min + E_min / B to the best
rule at each batch, whose B_crit = E_min / S_min stands beside the measured noise scale; the loss curves' figure."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

WITHIN = 1.05  # "within 5%" of the base run's final validation loss


def newest(records: list[dict[str, Any]]) -> dict[tuple[int, str, str, int], dict[str, Any]]:
    """The newest record of each (multiple, rule, epochs rule, seed)."""
    return {(r["multiple"], r["rule"], r["epochs_rule"], r["seed"]): r for r in records}


def reached(record: dict[str, Any], target: float) -> dict[str, float] | None:
    """The first validation at or below ``target`` (its step, samples and seconds), or None."""
    return next((point for point in record["curve"] if point["step"] > 0 and point["loss"] <= target), None)


def targets(runs: dict[tuple, dict[str, Any]]) -> dict[int, float]:
    """Per seed, the base run's final validation loss: the target of that seed's runs."""
    return {seed: r["final_val_loss"] for (_, rule, _, seed), r in runs.items() if rule == "base"}


def fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """S_min and E_min of S(B) = S_min + E_min / B by least squares over (batch, steps) points; None below two."""
    if len({b for b, _ in points}) < 2:
        return None
    xs, ys = [1 / b for b, _ in points], [s for _, s in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def best_steps(runs: dict[tuple, dict[str, Any]], tgts: dict[int, float]) -> dict[int, dict[int, tuple[str, float]]]:
    """Per seed and global batch, the fewest steps to the seed's target over the rules and epochs rules."""
    best: dict[int, dict[int, tuple[str, float]]] = {}
    for (_, rule, epochs, seed), r in runs.items():
        hit = reached(r, tgts[seed]) if seed in tgts else None
        if hit is None:
            continue
        mine = best.setdefault(seed, {})
        if r["global_batch"] not in mine or hit["step"] < mine[r["global_batch"]][1]:
            mine[r["global_batch"]] = (rule if rule == "base" else f"{rule}, {epochs}", hit["step"])
    return best


def _point(point: dict[str, float] | None) -> str:
    return "not reached" if point is None else f"{point['step']:.0f} ({point['samples']:,.0f})"


def _cell(r: dict[str, Any], target: float) -> str:
    return f"{_point(reached(r, target))}; {_point(reached(r, WITHIN * target))}"


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: one row per (global batch, rule, epochs rule), seeds side by side; then the fit."""
    runs = newest(records)
    tgts = targets(runs)
    lines = [
        "Targets (each seed's base run, final validation loss): "
        + ", ".join(f"seed {s} {t:.5f}" for s, t in sorted(tgts.items())),
        "",
        "| global batch | rule | epochs rule | peak lr | steps (samples) "
        "| steps to the base's loss (samples); within 5% | final loss | B_simple at the end | training s |",
        "| ---: | --- | --- | ---: | ---: | --- | --- | --- | ---: |",
    ]
    rows: dict[tuple, list[dict[str, Any]]] = {}
    for key, r in sorted(runs.items(), key=lambda item: (item[0][0], item[0][2], item[0][1], item[0][3])):
        rows.setdefault(key[:3], []).append(r)
    for (_, rule, epochs), rs in rows.items():
        first = rs[0]
        cells = " / ".join(_cell(r, tgts[r["seed"]]) if r["seed"] in tgts else "-" for r in rs)
        losses = " / ".join(f"{r['final_val_loss']:.5f}" for r in rs)
        noise = " / ".join(f"{r['b_simple'][-1][1]:.0f}" if r["b_simple"] else "-" for r in rs)
        lines.append(
            f"| {first['global_batch']} | {rule} | {epochs} | {first['peak_lr']:.2e} "
            f"| {first['steps']} ({first['steps'] * first['global_batch']:,}) | {cells} | {losses} | {noise} "
            f"| {statistics.mean(r['train_wall_s'] for r in rs):.0f} |"
        )
    return "\n".join([*lines, "", *fit_lines(runs, tgts)])


def fits(records: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """Per seed whose fit holds: (S_min, E_min, the base batch) of its fewest steps at each batch."""
    runs = newest(records)
    tgts = targets(runs)
    found = []
    for seed, best in best_steps(runs, tgts).items():
        fitted = fit([(batch, steps) for batch, (_, steps) in best.items()])
        if fitted is not None and fitted[0] > 0 and fitted[1] > 0:
            base = next(r for (_, rule, _, s), r in runs.items() if rule == "base" and s == seed)
            found.append((*fitted, base["global_batch"]))
    return found


def fit_lines(runs: dict[tuple, dict[str, Any]], tgts: dict[int, float]) -> list[str]:
    """Per seed, the fit to the fewest steps at each batch, beside the base run's measured noise scale."""
    lines = []
    best = best_steps(runs, tgts)
    for seed in sorted(tgts):
        base = next(r for (_, rule, _, s), r in runs.items() if rule == "base" and s == seed)
        measured = [b for _, b in base["b_simple"][len(base["b_simple"]) // 2 :]]
        noise = f"{statistics.median(measured):.0f}" if measured else "not measured"
        points = [(batch, steps) for batch, (_, steps) in best.get(seed, {}).items()]
        fitted = fit(points)
        said = ", ".join(f"{batch}: {steps:.0f} ({rule})" for batch, (rule, steps) in best.get(seed, {}).items())
        if fitted is None or fitted[0] <= 0 or fitted[1] <= 0:
            lines.append(f"- seed {seed}: fewest steps {said or '-'}; no fit; base run's B_simple {noise}")
            continue
        s_min, e_min = fitted
        lines.append(
            f"- seed {seed}: fewest steps {said}; fit S_min {s_min:.0f} steps, E_min {e_min:.0f} samples, "
            f"B_crit = E_min / S_min {e_min / s_min:.0f}; the base run's B_simple (median, its second half) {noise}"
        )
    return lines


RULE_STYLES = {"none": ":", "sqrt": "--", "linear": "-"}


def figure(records: list[dict[str, Any]], path: Path) -> None:
    """Validation loss against optimizer steps and against samples, seed 0: a colour per global batch, a line style
    per learning-rate rule, the ``half`` runs bold and the ``samples`` runs faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = newest(records)
    seeds = sorted({seed for *_, seed in runs})
    if not seeds:
        return
    fig, (by_steps, by_samples) = plt.subplots(1, 2, figsize=(12, 4.8))
    tgts = targets(runs)
    batches = sorted({r["global_batch"] for r in runs.values()})
    colours = dict(
        zip(
            batches,
            plt.get_cmap("viridis")([i / max(len(batches) - 1, 1) * 0.9 for i in range(len(batches))]),
            strict=True,
        )
    )
    for (_, rule, epochs, seed), r in sorted(runs.items()):
        if seed != seeds[0]:
            continue
        scaling = rule.partition("+warmup")[0]
        style = {"color": "black" if rule == "base" else colours[r["global_batch"]]}
        style |= {"linestyle": RULE_STYLES.get(scaling, "-"), "linewidth": 0.9 if epochs == "samples" else 1.8}
        style |= {"alpha": 0.45 if epochs == "samples" else 1.0}
        points = [p for p in r["curve"] if p["step"] > 0]
        by_steps.plot([p["step"] for p in points], [p["loss"] for p in points], **style)
        by_samples.plot([p["samples"] for p in points], [p["loss"] for p in points], **style)
    for ax, what in ((by_steps, "optimizer steps"), (by_samples, "samples")):
        if seeds[0] in tgts:
            ax.axhline(tgts[seeds[0]], color="gray", linestyle="-.", linewidth=0.8)
        ax.set(xscale="log", yscale="log", xlabel=what, ylabel="validation loss")
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color="black", label=f"{batches[0]}, base")]
    handles += [Line2D([], [], color=colours[b], linewidth=1.8, label=f"global batch {b}") for b in batches[1:]]
    handles += [
        Line2D([], [], color="gray", linestyle=dashes, label=f"lr: {rule}") for rule, dashes in RULE_STYLES.items()
    ]
    handles += [Line2D([], [], color="gray", linewidth=1.8, label="half the base's steps")]
    handles += [Line2D([], [], color="gray", linewidth=0.9, alpha=0.45, label="the base's samples")]
    by_samples.legend(handles=handles, fontsize=7, ncol=2)
    fig.suptitle(
        f"convergence against global batch and learning-rate rule (seed {seeds[0]}; dash-dot: the base's loss)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
