"""Host memory under a long run: is it flat, or does something grow epoch after epoch?

    python -m bench.soak --minutes 30              # trains the debug config that long, then reports
    python -m bench.soak --report RUN_DIR          # reports on an existing run directory

Reads ``memory/host_rss_mib`` from the run's metrics.jsonl and appends one record to
bench/results/soak.jsonl: RSS medians early and late, and the slope over the second half.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.cases import launch
from bench.env import REPO, append_records, environment, read_records
from common.cli import ArgumentParser, existing_dir, output_file
from trainer.rundir import CONFIG, METRICS

RESULTS = REPO / "bench" / "results" / "soak.jsonl"


def memory_trend(run_dir: Path) -> dict[str, Any]:
    records = read_records(run_dir / METRICS)
    points = [(r["time_s"], r["memory/host_rss_mib"]) for r in records if "memory/host_rss_mib" in r]
    if len(points) < 20:
        raise ValueError(f"{run_dir}: only {len(points)} memory records; run longer")
    rss = [m for _, m in points]
    tenth = len(rss) // 10
    second_half = points[len(points) // 2 :]
    mean_t = statistics.fmean(t for t, _ in second_half)
    mean_m = statistics.fmean(m for _, m in second_half)
    slope = sum((t - mean_t) * (m - mean_m) for t, m in second_half) / sum((t - mean_t) ** 2 for t, _ in second_half)
    return {
        "duration_s": points[-1][0],
        "log_points": len(points),
        "epochs": max(r.get("epoch", 0) for r in records),
        "rss_mib_first_tenth_median": statistics.median(rss[:tenth]),
        "rss_mib_last_tenth_median": statistics.median(rss[-tenth:]),
        "rss_mib_min": min(rss),
        "rss_mib_max": max(rss),
        "rss_mib_per_hour_second_half": slope * 3600,
    }


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--config", default="debug")
    parser.add_argument("--report", type=existing_dir, help="only report on this existing run directory")
    parser.add_argument(
        "--commit", help="the commit the reported run was made with, where its config.json does not say"
    )
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")
    if args.report is not None and not (args.report / METRICS).is_file():
        parser.error(f"{args.report}: no {METRICS} (not a run directory?)")
    run_dir = args.report
    if run_dir is None:
        run_dir = REPO / "runs" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
        cmd = [
            sys.executable,
            "ds_train.py",
            "--config",
            args.config,
            "--num_epochs",
            "100000",
            "--run_dir",
            str(run_dir),
        ]
        # past its time the run gets SIGTERM: it checkpoints at its next step and exits 75
        code = launch(cmd, timeout_s=args.minutes * 60, capture=False, stop=signal.SIGTERM).returncode
        if code not in (0, 75):
            sys.exit(f"the soak run failed (exit status {code}): its output above says why")
    saved = json.loads((run_dir / CONFIG).read_text()) if (run_dir / CONFIG).exists() else {}
    env = environment()
    env["commit"] = saved.get("commit") or args.commit or env["commit"]
    try:
        trend = memory_trend(run_dir)
    except ValueError as err:
        sys.exit(f"error: {err}")
    record = {"bench": "soak", "run_dir": str(run_dir), **trend, **env}
    append_records(args.out, [record])
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
