"""Loss remedies compared side by side: each arm trained with each seed, then its validation box predicted.

    python -m studies.remedies                                   # the debug config, the arms below, seeds 0 and 1
    python -m studies.remedies --config science --universes 20 --seeds 2 --arms baseline --calibrate
    python -m studies.remedies --table                           # the table of the newest records, nothing run

An arm is ``name`` (the config as it is) or ``key=value[,key=value]`` (ds_train.py's options, without the dashes);
a universe is a synthetic seed, whose boxes go beside the config's (data/synthetic/science-20/); ``--calibrate``
judges the prediction again after model.calibrate's gains, fitted on the training box (arm "... +gains"). Finished
steps are not run again. Each (universe, arm, seed) is a record in bench/results/remedies.jsonl: L1 per channel,
the science target's statistics per field, the training's wall time and step rate, and gas density's and
temperature's power ratio and r per shell of k.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.cases import launch
from bench.env import REPO, append_records, environment, read_records
from common.cli import ArgumentParser, output_file
from common.files import written_atomically
from trainer.config import load_named
from trainer.rundir import SUMMARY

RESULTS = REPO / "bench" / "results" / "remedies.jsonl"
SHELLS = ("gas_density", "temperature")  # the fields whose spectra the records keep shell by shell
ARMS = ["baseline", "lambda_T=0.1", "lambda_hot=0.3", "num_epochs=10"]


def arm_options(arm: str) -> list[str]:
    """ds_train.py's options for an arm: 'baseline' none, else --key value for each key=value."""
    if arm == "baseline":
        return []
    options = []
    for pair in arm.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"arm {arm!r}: expected 'baseline' or key=value[,key=value]")
        options += [f"--{key}", value]
    return options


def _run(command: list[str]) -> None:
    launched = launch(command, capture=False)
    if launched.returncode != 0:
        sys.exit(f"failed (exit status {launched.returncode}): {' '.join(command)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Universe:
    """The synthetic boxes a run trains and is judged on: ``seed`` the spec's seed, ``options`` what ds_train.py
    needs to get them (none for the config's own), and the two boxes' paths (the training box fits the gains)."""

    seed: int | None
    options: tuple[str, ...]
    train_path: str
    val_path: str
    suffix: str  # of the run directory's name: empty for the config's own boxes


def universe(cfg: dict[str, Any], seed: int | None) -> Universe:
    """The config's own boxes (``seed`` None or the config's own synthetic seed) or another universe's, generated
    in a directory beside the config's named after its seed."""
    own = (cfg.get("synthetic") or {}).get("seed")
    if seed is None or seed == own:
        paths = {"train_path": str(REPO / cfg["train_path"]), "val_path": str(REPO / cfg["val_path"])}
        return Universe(seed=own, options=(), suffix="", **paths)
    if not cfg.get("synthetic"):
        raise ValueError(f"--universes needs a config with synthetic boxes; {cfg['train_path']} is not one")
    data = Path(cfg["train_path"]).parent
    data = data.with_name(f"{data.name}-{seed}")
    train, val = data / "train.h5", data / "val.h5"
    options = ("--synthetic.seed", str(seed), "--train_path", str(train), "--val_path", str(val))
    paths = {"train_path": str(REPO / train), "val_path": str(REPO / val)}
    return Universe(seed=seed, options=options, suffix=f"-u{seed}", **paths)


def run_arm(config: str, arm: str, seed: int, *, out_dir: Path, boxes: Universe, calibrate: bool) -> list[dict]:
    """Train the arm with this seed on these boxes (unless its directory holds a finished run) and predict the
    validation box; its record, and with ``calibrate`` a second one of the prediction calibrated by gains fitted
    on the training box's (model.calibrate). Steps whose outputs are there are not run again."""
    run_dir = out_dir / f"{config}-{arm.replace('=', '_').replace(',', '+')}{boxes.suffix}-seed{seed}"
    summary_path, metrics_path = run_dir / SUMMARY, run_dir / "prediction" / "metrics.json"
    if not (summary_path.exists() and json.loads(summary_path.read_text()).get("finished")):
        options = ["--config", config, "--seed", str(seed), "--run_dir", str(run_dir), *boxes.options]
        options += arm_options(arm)
        _run([sys.executable, "ds_train.py", *options, *(["--overwrite"] if run_dir.exists() else [])])
    if not metrics_path.exists():
        started = time.perf_counter()
        _run([sys.executable, "-m", "model.predict", "--run_dir", str(run_dir), "--input", boxes.val_path])
        print(f"predicted in {time.perf_counter() - started:.0f} s", flush=True)
    summary = json.loads(summary_path.read_text())
    records = [_record(config, arm, seed, boxes=boxes, run_dir=run_dir, summary=summary, metrics_path=metrics_path)]
    if calibrate:
        on_train, gains, calibrated = run_dir / "prediction-train", run_dir / "gains.json", run_dir / "calibrated"
        predict = [sys.executable, "-m", "model.predict", "--run_dir", str(run_dir), "--input", boxes.train_path]
        calibrate_cmd = [sys.executable, "-m", "model.calibrate", "--calibration", str(gains)]
        if not (on_train / "metrics.json").exists():
            _run([*predict, "--out", str(on_train)])
        if not gains.exists():
            _run([*calibrate_cmd, "--fit", str(on_train / "prediction.h5"), "--truth", boxes.train_path])
        if not (calibrated / "metrics.json").exists():
            apply = ["--apply", str(metrics_path.parent / "prediction.h5"), "--truth", boxes.val_path]
            _run([*calibrate_cmd, *apply, "--out", str(calibrated)])
        records.append(
            _record(
                config,
                f"{arm} +gains",
                seed,
                boxes=boxes,
                run_dir=run_dir,
                summary=summary,
                metrics_path=calibrated / "metrics.json",
            )
        )
    return records


def _record(
    config: str, arm: str, seed: int, *, boxes: Universe, run_dir: Path, summary: dict, metrics_path: Path
) -> dict[str, Any]:
    metrics = json.loads(metrics_path.read_text())
    record: dict[str, Any] = {
        "bench": "remedies",
        "config": config,
        "arm": arm,
        "universe": boxes.seed,
        "seed": seed,
        "run_dir": str(run_dir),
        "metrics": str(metrics_path),
        "final_val_loss": summary["final_val_loss"],
        "train_wall_s": summary["wall_s"],
        "samples_per_s": summary["samples_per_s"],
        "global_batch": summary["global_batch"],
        "l1": metrics["l1"],
        "k_max": metrics["target"]["k_max"],
        "k_ranges": metrics["k_ranges"],
        "summary": metrics["summary"],
    }
    record["target"] = {field: stats for field, stats in metrics["target"].items() if isinstance(stats, dict)}
    record["shells"] = {field: {key: metrics[field][key] for key in ("k", "power_ratio", "r")} for field in SHELLS}
    return record


def _arm(record: dict[str, Any]) -> str:
    """The arm as the tables name it: with its universe where the record says which (older ones do not)."""
    return record["arm"] if record.get("universe") is None else f"{record['arm']} (universe {record['universe']})"


def _span(records: list[dict[str, Any]], field: str) -> str:
    """A field's power ratios (lowest-highest over the target's shells) and lowest r, one seed after another."""
    cells = []
    for r in records:
        t = r["target"][field] if field in r["target"] else r["velocity_target"][field]  # older records: apart
        if t["r_min"] is None:
            cells.append("-")
        else:
            cells.append(f"{t['power_ratio_min']:.2f}-{t['power_ratio_max']:.2f}, {t['r_min']:.3f}")
    return " / ".join(cells)


def _l1(records: list[dict[str, Any]], *channels: str) -> str:
    """The L1 of a channel (the mean of several), one seed after another."""
    return " / ".join(f"{statistics.mean(r['l1'][c] for c in channels):.5f}" for r in records)


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: one row per (config, arm), its seeds side by side (separated by /); the velocity's L1 is the mean of
    its three components', the step time the global batch over the training's median rate, the mean over the seeds."""
    rows = [
        "| config | arm | seeds | L1 gas density | L1 velocity | L1 temperature | gas density P/P, min r "
        "| temperature P/P, min r | vx P/P, min r | vy P/P, min r | vz P/P, min r | speed P/P, min r "
        "| step ms (median) | training s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    newest: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in records:
        newest[(r["config"], _arm(r), r["seed"])] = r
    arms: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (config, arm, _), r in sorted(newest.items(), key=lambda item: item[0][2]):
        arms.setdefault((config, arm), []).append(r)
    for (config, arm), rs in arms.items():
        rows.append(
            f"| {config} | {arm} | {' / '.join(str(r['seed']) for r in rs)} "
            f"| {_l1(rs, 'gas_density')} | {_l1(rs, 'vx', 'vy', 'vz')} | {_l1(rs, 'temperature')} "
            f"| {_span(rs, 'gas_density')} | {_span(rs, 'temperature')} "
            f"| {_span(rs, 'vx')} | {_span(rs, 'vy')} | {_span(rs, 'vz')} | {_span(rs, 'speed')} "
            f"| {statistics.mean(1000 * r['global_batch'] / r['samples_per_s'] for r in rs):.0f} "
            f"| {statistics.mean(r['train_wall_s'] for r in rs):.0f} |"
        )
    return "\n".join(rows)


RANGES = ("large_scales", "intermediate")  # the small scales lie beyond the synthetic gas's smoothing


def range_table(records: list[dict[str, Any]]) -> str:
    """Markdown: per (config, arm, seed), the medians over model.predict's large-scale and intermediate k ranges
    of P/P and r for gas density and temperature (records from before the ranges were kept are left out)."""
    fields = ("gas_density", "temperature")
    head = " | ".join(f"{f.replace('_', ' ')} {name.replace('_', ' ')}" for f in fields for name in RANGES)
    rows = [f"| config | arm | seed | k ranges | {head} |", "| --- | --- | --- | --- |" + " --- |" * 4]
    newest = {(r["config"], _arm(r), r["seed"]): r for r in records if "summary" in r}
    for (config, arm, seed), r in newest.items():
        ks = " / ".join("-".join(map(str, r["k_ranges"][name])) for name in RANGES)
        cells = []
        for f in fields:
            for name in RANGES:
                ratio, corr = r["summary"][f"{f}_power_ratio_{name}"], r["summary"][f"{f}_r_{name}"]
                cells.append("-" if ratio is None else f"{ratio:.3f}, {corr:.3f}")
        rows.append(f"| {config} | {arm} | {seed} | {ks} | {' | '.join(cells)} |")
    return "\n".join(rows)


def shell_table(records: list[dict[str, Any]]) -> str:
    """Markdown: per (config, arm, seed) with spectra kept per shell, the temperature's lowest-highest P/P in each
    quarter of the target's shells and its lowest r over them, and gas density's over all of them."""
    kept = {(r["config"], _arm(r), r["seed"]): r for r in records if "shells" in r}
    if not kept:
        return ""
    rows = [
        "| config | arm | seed | temperature P/P in quarters of the target's shells | temperature min r "
        "| gas density P/P, min r |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (config, arm, seed), r in kept.items():
        k_max = r["k_max"]
        bounds = [(1 + q * k_max // 4, (q + 1) * k_max // 4) for q in range(4)]
        t, rho = r["shells"]["temperature"], r["shells"]["gas_density"]
        cells = []
        for low, high in bounds:
            ratios = [p for k, p in zip(t["k"], t["power_ratio"], strict=True) if low <= k <= high]
            cells.append(f"k {low}-{high}: {min(ratios):.3f}-{max(ratios):.3f}")
        judged = [i for i, k in enumerate(t["k"]) if k <= k_max]
        rho_ratios = [rho["power_ratio"][i] for i in judged]
        rows.append(
            f"| {config} | {arm} | {seed} | {'; '.join(cells)} | {min(t['r'][i] for i in judged):.3f} "
            f"| {min(rho_ratios):.3f}-{max(rho_ratios):.3f}, {min(rho['r'][i] for i in judged):.3f} |"
        )
    return "\n".join(rows)


def figure(records: list[dict[str, Any]], path: Path) -> Path:
    """Gas density's and temperature's P_pred / P_true per shell for each run with spectra kept and its calibrated
    twin ("... +gains"), as trained (dashed) and calibrated (solid), with the tight target's band and last k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = {}
    for r in records:
        if "shells" in r:
            pairs.setdefault((r["config"], r["arm"].removesuffix(" +gains"), r.get("universe"), r["seed"]), {})[
                "calibrated" if r["arm"].endswith(" +gains") else "trained"
            ] = r
    pairs = {key: pair for key, pair in pairs.items() if len(pair) == 2}
    if not pairs:
        raise ValueError("no run with its calibrated twin in the records (studies.remedies --calibrate)")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, ((_, arm, universe, seed), pair) in enumerate(sorted(pairs.items(), key=str)):
        color = plt.get_cmap("tab10")(i)
        k_max = pair["trained"]["k_max"]
        for ax, (field, band) in zip(axes, (("gas_density", 0.03), ("temperature", 0.05)), strict=True):
            for which, style in (("trained", "--"), ("calibrated", "-")):
                shells = pair[which]["shells"][field]
                k = [k for k in shells["k"] if k <= 2 * k_max]
                label = f"{arm}, universe {universe}, seed {seed}, {which}" if field == "temperature" else None
                ax.plot(k, shells["power_ratio"][: len(k)], style, color=color, label=label)
            ax.axhspan(1 - band, 1 + band, color="0.9", zorder=0)
            ax.axvline(k_max, color="0.5", lw=0.8)
            ax.set(title=f"{field.replace('_', ' ')}: tight target within {band:.0%} to k = {k_max}", xlabel="k")
    axes[0].set_ylabel("P_pred / P_true")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    with written_atomically(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    return path


def _report(records: list[dict[str, Any]], path: Path | None, parser: ArgumentParser) -> None:
    """The tables, and the figure where ``path`` is given."""
    print("\n\n".join(filter(None, (table(records), range_table(records), shell_table(records)))))
    if path:
        try:
            print(f"wrote {figure(records, path)}")
        except ValueError as err:
            parser.error(str(err))


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m studies.remedies", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="debug")
    parser.add_argument("--arms", nargs="+", default=ARMS, help="'baseline' or key=value[,key=value] each")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument(
        "--universes", nargs="+", type=int, default=[None], help="synthetic seeds of the boxes (default: the config's)"
    )
    parser.add_argument("--out_dir", type=Path, default=REPO / "runs" / "remedies", help="where the runs go")
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    parser.add_argument(
        "--calibrate", action="store_true", help="also judge the prediction calibrated on the training box's"
    )
    parser.add_argument("--table", action="store_true", help="only print the table of the results file")
    parser.add_argument("--figure", type=output_file, help="also draw the calibrated runs' spectra (PNG)")
    args = parser.parse_args(argv)
    if args.table:
        records = read_records(args.out) if args.out.exists() else []
        _report(records, args.figure, parser)
        return
    for arm in args.arms:
        try:
            arm_options(arm)
        except ValueError as err:
            parser.error(str(err))
    cfg = load_named(REPO / "ds_configs" / "UNet.yaml", args.config)
    try:
        universes = [universe(cfg, seed) for seed in args.universes]
    except ValueError as err:
        parser.error(str(err))
    env = environment()
    for boxes in universes:
        for arm in args.arms:
            for seed in args.seeds:
                records = run_arm(args.config, arm, seed, out_dir=args.out_dir, boxes=boxes, calibrate=args.calibrate)
                append_records(args.out, [record | env for record in records])
    arms = {*args.arms, *(f"{arm} +gains" for arm in args.arms)}
    records = [r for r in read_records(args.out) if r["config"] == args.config and r["arm"] in arms]
    _report(records, args.figure, parser)


if __name__ == "__main__":
    main()
