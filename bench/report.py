"""Plots and a markdown table from bench/results/train.jsonl: the training table of docs/benchmarks.md.

    python -m bench.report        # newest sweep run per device -> bench/results/*.png and docs/benchmarks.md

Plots: throughput against ranks with the ideal line, scaling efficiency, the step-time breakdown
(forward / backward / optimizer), throughput against micro-batch.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from bench.cases import sweep_of
from bench.env import DOC, REPO, read_records, update_doc
from bench.train import RESULTS
from common.cli import ArgumentParser, existing_file, output_dir

PLOTS = REPO / "bench" / "results"


def newest_runs(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per device, the records of its newest sweep run."""
    newest: dict[str, str] = {}
    for r in records:
        newest[r["device"]] = max(newest.get(r["device"], ""), r["run_id"])
    return {d: [r for r in records if r["device"] == d and r["run_id"] == run] for d, run in newest.items()}


def scaling(rows: list[dict[str, Any]], sweep: str, mode: str = "synthetic") -> list[tuple[int, float, float]]:
    """(ranks, samples/s, efficiency) of a scaling sweep's ``mode`` steps: throughput over ranks x one rank's,
    each the median over the repeated runs of that rank count."""
    runs: dict[int, list[float]] = {}
    for r in rows:
        if r["sweep"] == sweep and r["mode"] == mode:
            runs.setdefault(r["world_size"], []).append(r["samples_per_s"])
    points = sorted((n, statistics.median(rates)) for n, rates in runs.items())
    if not points or points[0][0] != 1:
        return []
    one = points[0][1]
    return [(n, rate, rate / (n * one)) for n, rate in points]


def engine_overhead(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Per precision, the DeepSpeed engine's step time over the plain loop's, on the same batch (p50s)."""
    ratios = []
    for r in rows:
        if r["mode"] == "synthetic" and sweep_of(r["sweep"]).phases:
            plain = next(
                (p for p in rows if p["mode"] == "plain" and p["case"] == r["case"] and p["sweep"] == r["sweep"]), None
            )
            if plain:
                ratios.append((r["precision"], r["step_ms_p50"] / plain["step_ms_p50"]))
    return ratios


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(device: str, rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    lines = [
        f"**{device}** ({first['cpu']}, {first['cores']} cores); torch {first['torch']}, "
        f"DeepSpeed {first['deepspeed']}, run {first['run_id']}; {first['timed_steps']} timed steps after "
        f"{first['warmup_steps']} discarded; model width {first['unet_width']}, depth {first['unet_depth']}, "
        f"{first['crop']}^3 crops, "
        f"{first['train_flops_per_sample'] / 1e9:.2f} GFLOP per training sample (counted from the model).",
        "",
    ]
    for precision, ratio in engine_overhead(rows):
        lines.append(
            f"- DeepSpeed engine step / plain PyTorch step ({precision}, same model and batch): **{ratio:.3f}**"
        )
    scaling_sweeps = sorted({r["sweep"] for r in rows if sweep_of(r["sweep"]).scaling})
    engines = (("synthetic", "DeepSpeed"), ("plain", "plain PyTorch DDP"))
    for sweep, mode, who in [(s, mode, who) for s in scaling_sweeps for mode, who in engines]:
        points = scaling(rows, sweep, mode)
        if len(points) > 1:
            lines.append(
                f"- {sweep} scaling efficiency, {who} (median samples/s over repeated runs): "
                + ", ".join(f"{n} ranks **{e:.2f}**" for n, _, e in points[1:])
            )
    lines += [
        "",
        "| sweep | case | mode | ranks | micro x acc / global | precision | samples/s | step ms p50 / p90 / p99 "
        "| fwd / bwd / opt ms | data wait | memory GiB | TFLOP/s | MFU |",
        "| --- | --- | --- | ---: | --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        phases = " / ".join(_fmt(r.get(f"{p}_ms_p50")) for p in ("forward", "backward", "optimizer"))
        run = f" (run {r['repeat'] + 1})" if r.get("repeat") else ""
        lines.append(
            f"| {r['sweep']} | {r['case']}{run} | {r['mode']} | {r['world_size']} | "
            f"{r['micro_batch']} x {r['accumulation']} / {r['global_batch']} | {r['precision']} | "
            f"{r['samples_per_s']:.1f} | {r['step_ms_p50']:.0f} / "
            f"{r['step_ms_p90']:.0f} / {r['step_ms_p99']:.0f} | {phases} | {r['data_wait_pct']:.0f}% | "
            f"{r['mem_peak_gib']:.2f} ({r['mem_kind']}) | {_fmt(r.get('achieved_tflops'), 3)} | "
            f"{_fmt(r.get('mfu'), 3)} |"
        )
    peaks = sorted({r["peak_source"] for r in rows if r.get("peak_source")})
    lines += ["", "Peaks for MFU: " + "; ".join(peaks) + "."] if peaks else []
    return "\n".join(lines)


def plots(device: str, rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slug = "cpu" if device == "cpu" else device.lower().replace(" ", "-")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for sweep, marker in zip(
        sorted({r["sweep"] for r in rows if sweep_of(r["sweep"]).scaling}), "osD^v<>p*", strict=False
    ):
        points = scaling(rows, sweep)
        if points:
            ranks = [n for n, _, _ in points]
            left.plot(ranks, [r for _, r, _ in points], marker=marker, label=f"{sweep} scaling")
            left.plot(ranks, [points[0][1] * n for n in ranks], linestyle=":", color="gray")  # ideal: N x one rank
            right.plot(ranks, [e for _, _, e in points], marker=marker, label=sweep)
    left.set(xlabel="ranks", ylabel="samples/s (synthetic steps)", title="Throughput (dotted: ideal)")
    right.set(xlabel="ranks", ylabel="efficiency", title="Scaling efficiency", ylim=(0, 1.1))
    right.axhline(0.8, color="gray", linestyle=":")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    written.append(_save(fig, device, out_dir / f"scaling_{slug}.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    phased = [r for r in rows if r.get("forward_ms_p50") is not None and sweep_of(r["sweep"]).phases]
    labels = [f"{r['case']}\n{r['mode']}" for r in phased]
    bottom = [0.0] * len(phased)
    for phase in ("forward", "backward", "optimizer"):
        values = [r[f"{phase}_ms_p50"] for r in phased]
        left.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set(ylabel="ms per optimizer step (p50)", title="Step time breakdown")
    left.legend()
    micro = sorted((r["micro_batch"], r["samples_per_s"]) for r in rows if sweep_of(r["sweep"]).micro_batch)
    if micro:
        right.plot([m for m, _ in micro], [s for _, s in micro], marker="o")
        right.set_xscale("log", base=2)
    right.set(xlabel="micro-batch per rank", ylabel="samples/s (synthetic steps)", title="Throughput vs micro-batch")
    right.grid(alpha=0.3)
    written.append(_save(fig, device, out_dir / f"steps_{slug}.png"))
    return written


def _save(fig: Any, device: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(device)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=existing_file, default=RESULTS, help="records of bench.train (JSON lines)")
    parser.add_argument("--plots", type=output_dir, default=PLOTS, help="directory for the plots")
    parser.add_argument("--doc", type=existing_file, default=DOC, help="markdown page whose table to regenerate")
    args = parser.parse_args(argv)
    records = read_records(args.results)
    sections = []
    for device, rows in sorted(newest_runs(records).items()):
        written = plots(device, rows, args.plots)
        figures = " ".join(f"![{p.stem}]({os.path.relpath(p, args.doc.parent)})" for p in written)
        sections.append(table(device, rows) + "\n\n" + figures)
    text = "\n\n".join(sections)
    print(text)
    update_doc(args.doc, text, name="train")


if __name__ == "__main__":
    main()
