"""What a per-shell gain fitted on a run's training box would make of its validation box's power, judged by the
tight science target.

    python -m studies.transfer runs/remedies/science-baseline-u20-seed2 [RUN_DIR ...]

Each run directory needs its validation box's metrics (prediction/, as studies.remedies leaves them) and its training
box's (prediction-train/: model.predict --input TRAIN.h5 --out RUN/prediction-train). Multiplying the prediction's
Fourier modes by sqrt(P_true / P_pred) of the training box at the same scale (the boxes share their voxel size)
multiplies each shell's power ratio by that gain squared and leaves its r: fitted without the validation box, it
gives the validation box's ratios after such a calibration. Records in bench/results/transfer.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.env import REPO, append_records, environment
from common.cli import ArgumentParser, output_file

RESULTS = REPO / "bench" / "results" / "transfer.jsonl"
# The tight science target, per field: the largest |P_pred / P_true - 1| and the lowest r in every shell to the
# target's k_max (a quarter of Nyquist).
TIGHT = {
    "gas_density": (0.03, 0.99),
    "temperature": (0.05, 0.99),
    "vx": (0.05, 0.97),
    "vy": (0.05, 0.97),
    "vz": (0.05, 0.97),
}
CALIBRATED = ("gas_density", "temperature")  # the fields a gain is fitted for; the velocities are judged as they are


def calibrated(val: dict[str, Any], train: dict[str, Any]) -> list[float | None]:
    """A field's validation power ratio per shell after the gain fitted on the training box (None for a shell the
    training box does not reach at the same scale)."""
    factor, rest = divmod(len(train["k"]), len(val["k"]))
    if rest or factor < 1:
        raise ValueError(
            f"the training box's {len(train['k'])} shells are not a multiple of the validation's {len(val['k'])}"
        )
    out: list[float | None] = []
    for k, ratio in zip(val["k"], val["power_ratio"], strict=True):
        shell = k * factor
        out.append(ratio / train["power_ratio"][shell - 1] if shell <= len(train["k"]) else None)
    return out


def judge(field: str, ratios: list[float | None], r: list[float]) -> dict[str, Any]:
    """The lowest and highest ratio and the lowest r over the given shells, and whether the tight target holds."""
    tolerance, min_r = TIGHT[field]
    if any(x is None for x in ratios):
        return {"power_ratio_min": None, "power_ratio_max": None, "r_min": min(r), "met": None}
    low, high = min(ratios), max(ratios)  # type: ignore[type-var]
    met = 1 - tolerance <= low and high <= 1 + tolerance and min(r) >= min_r
    return {"power_ratio_min": low, "power_ratio_max": high, "r_min": min(r), "met": met}


def study(run_dir: Path) -> dict[str, Any]:
    """The record of one run: per field the tight target before and (temperature, gas density) after the gain."""
    val = json.loads((run_dir / "prediction" / "metrics.json").read_text())
    train = json.loads((run_dir / "prediction-train" / "metrics.json").read_text())
    k_max = val["target"]["k_max"]
    record: dict[str, Any] = {"bench": "transfer", "run_dir": str(run_dir), "k_max": k_max, "fields": {}}
    for field in TIGHT:
        ratio, r = val[field]["power_ratio"][:k_max], val[field]["r"][:k_max]
        entry = {"before": judge(field, ratio, r)}
        if field in CALIBRATED:
            after = calibrated(val[field], train[field])[:k_max]
            entry |= {"after": judge(field, after, r), "after_per_shell": after, "before_per_shell": ratio}
        record["fields"][field] = entry
    for when in ("before", "after"):
        record[f"met_{when}"] = all(e.get(when, e["before"])["met"] for e in record["fields"].values())
    return record


def _cell(stats: dict[str, Any]) -> str:
    if stats["power_ratio_min"] is None:
        return "-"
    mark = "" if stats["met"] else " (no)"
    return f"{stats['power_ratio_min']:.3f}-{stats['power_ratio_max']:.3f}, {stats['r_min']:.3f}{mark}"


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: per run, each field's power ratio range and lowest r before, and after the gain where fitted."""
    rows = [
        "| run | gas density | after the gain | temperature | after the gain | vx | vy | vz | tight target met "
        "(before / after) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rec in records:
        f = rec["fields"]
        cells = [
            _cell(f["gas_density"]["before"]),
            _cell(f["gas_density"]["after"]),
            _cell(f["temperature"]["before"]),
            _cell(f["temperature"]["after"]),
            *(_cell(f[v]["before"]) for v in ("vx", "vy", "vz")),
        ]
        verdict = f"{'yes' if rec['met_before'] else 'no'} / {'yes' if rec['met_after'] else 'no'}"
        rows.append(f"| {Path(rec['run_dir']).name} | {' | '.join(cells)} | {verdict} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m studies.transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        for which in ("prediction", "prediction-train"):
            if not (run_dir / which / "metrics.json").exists():
                parser.error(f"{run_dir / which / 'metrics.json'} is missing (the module's help says how to make it)")
    try:
        records = [study(run_dir) | environment() for run_dir in args.run_dirs]
    except ValueError as err:
        parser.error(str(err))
    append_records(args.out, records)
    print(table(records))


if __name__ == "__main__":
    main()
