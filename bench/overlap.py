"""How much of the gradient all-reduce a cluster's link exposes, per reduction: two ranks on two "nodes" over a shaped
link (``bench.link``) against the same two ranks over the unshaped one, so that the two cores' own contention cancels
out of the ratio (the link efficiency); rounds interleave the variants and the links.

    python -m bench.overlap                        # the debug config; the rate where stage 0's reduction is ~28%
    python -m bench.overlap --rate_mbit 120 --rounds 5
    python -m bench.overlap --table                # the table of the newest run, nothing run

Variants: DeepSpeed's stage 0 (reduced after backward), stage 0 overlapped with backward in buckets of a few sizes
(``gradient_reduction: overlapped``), ZeRO 1 and 2 with ``overlap_comm``. Each (variant, link, round) is bench.train's
synthetic record with the link's rate, in bench/results/overlap.jsonl; the exposed reduction is the step's time over
the shaped link less its time over the unshaped one.
"""

from __future__ import annotations

import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cases import rounds
from bench.env import DOC, REPO, append_records, read_records, update_doc
from bench.link import LinkError, Shape, carries, made, run_ranks
from common.cli import ArgumentParser, output_file
from common.tensors import DTYPES

RESULTS = REPO / "bench" / "results" / "overlap.jsonl"
SMALL_BUCKETS = '{"zero_optimization": {"reduce_bucket_size": 1000000, "allgather_bucket_size": 1000000}}'
VARIANTS: dict[str, list[str]] = {
    "stage 0": [],
    "overlapped, 1 MiB buckets": ["--gradient_reduction", "overlapped", "--reduce_bucket_mb", "1"],
    "overlapped, 4 MiB buckets": ["--gradient_reduction", "overlapped", "--reduce_bucket_mb", "4"],
    "overlapped, 25 MiB buckets": ["--gradient_reduction", "overlapped", "--reduce_bucket_mb", "25"],
    "ZeRO 1, overlap_comm": ["--deepspeed_config", "ds_configs/ds_fp16_zero1.json"],
    "ZeRO 2, overlap_comm": ["--deepspeed_config", "ds_configs/ds_fp16_zero2.json"],
    "ZeRO 2, overlap_comm, 1M-element buckets": [
        "--deepspeed_config",
        "ds_configs/ds_fp16_zero2.json",
        "--deepspeed_overrides",
        SMALL_BUCKETS,
    ],
}


def measure(variant: str, shape: Shape, args: Any, *, round_: int) -> dict[str, Any]:
    """bench.train's synthetic steps of ``variant`` on two ranks over a link shaped so; its record, with the link's."""
    with tempfile.TemporaryDirectory() as tmp, made(shape) as link:
        if not carries(link):
            raise LinkError("a veth pair between two network namespaces carries nothing on this machine")
        out = Path(tmp) / "train.jsonl"
        options = ["--config", args.config, "--modes", "synthetic", "--steps", str(args.steps)]
        options += ["--warmup", str(args.warmup), "--sweep", "overlap", "--case", variant, "--out", str(out)]
        command = [sys.executable, "-m", "bench.train", *options, *VARIANTS[variant], *args.train_options]
        results = run_ranks(link, command, timeout_s=args.timeout_s)
        for node, result in enumerate(results):
            if result.returncode != 0:
                raise SystemExit(f"{variant}, rank {node}: exit {result.returncode}\n{result.stderr[-3000:]}")
        (record,) = read_records(out)
    link_facts = {"rate_mbit": shape.rate_mbit, "burst_kib": shape.burst_kib, "latency_ms": shape.latency_ms}
    return record | {"bench": "overlap", "variant": variant, "round": round_, "link": link_facts}


def gradient_bytes(record: dict[str, Any]) -> int:
    """The bytes of a run's gradients: its parameters in its precision."""
    return record["parameters"] * DTYPES[record["precision"]].itemsize


def calibrated_rate(args: Any, *, overhead: float) -> float:
    """The rate at which stage 0's all-reduce is ``overhead`` of its step: from a step over the unshaped link and the
    gradients' bytes (a two-rank ring sends each rank's bytes once each way)."""
    record = measure("stage 0", Shape(rate_mbit=None), args, round_=-1)
    step_s, nbytes = record["step_ms_p50"] / 1000, gradient_bytes(record)
    reduce_s = overhead / (1 - overhead) * step_s
    return nbytes * 8 / reduce_s / 1e6


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: per variant, samples/s over both links, the link efficiency (median and spread over rounds), the
    exposed reduction and the wait of the overlapped one."""
    run = max(r["run_id"] for r in records)
    rows = [r for r in records if r["run_id"] == run]
    rate = next(r["link"]["rate_mbit"] for r in rows if r["link"]["rate_mbit"])
    first = rows[0]
    nbytes = gradient_bytes(first)
    lines = [
        f"Run {run} ({first['cpu']}, {first['cores']} cores; config {first['config']}, {first['parameters']:,} "
        f"parameters, {nbytes / 2**20:.1f} MiB of {first['precision']} gradients, micro-batch {first['micro_batch']} "
        f"on each of 2 ranks): link shaped to {rate:g} Mbit/s by tbf (burst {first['link']['burst_kib']} KiB, queue "
        f"{first['link']['latency_ms']:g} ms) on both ends; the all-reduce of the gradients takes "
        f"{nbytes * 8 / (rate * 1e6) * 1000:.0f} ms on it (bytes / rate).",
        "",
        "| variant | samples/s shaped | samples/s unshaped | link efficiency (spread) | step ms shaped / unshaped "
        "| exposed reduction ms | reduce wait ms |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        shaped = {r["round"]: r for r in mine if r["link"]["rate_mbit"]}
        free = {r["round"]: r for r in mine if not r["link"]["rate_mbit"]}
        ratios = [shaped[k]["samples_per_s"] / free[k]["samples_per_s"] for k in shaped if k in free]
        if not ratios:
            continue
        med = lambda rs, key: statistics.median(r[key] for r in rs.values())  # noqa: E731
        waits = [r["reduce_wait_ms_p50"] for r in shaped.values() if r.get("reduce_wait_ms_p50") is not None]
        wait = f"{statistics.median(waits):.0f}" if waits else "-"
        lines.append(
            f"| {variant} | {med(shaped, 'samples_per_s'):.1f} | {med(free, 'samples_per_s'):.1f} "
            f"| **{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {med(shaped, 'step_ms_p50'):.0f} / {med(free, 'step_ms_p50'):.0f} "
            f"| {med(shaped, 'step_ms_p50') - med(free, 'step_ms_p50'):.0f} | {wait} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="debug")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rate_mbit", type=float, help="the shaped link's rate (default: calibrated to --overhead)")
    parser.add_argument("--overhead", type=float, default=0.28, help="stage 0's reduction's share of its step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout_s", type=float, default=900.0)
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    parser.add_argument("--table", action="store_true", help="only the table of the newest run in --out")
    args, args.train_options = parser.parse_known_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the namespaces removed on the way out
    if not args.table:
        try:
            rate = args.rate_mbit or calibrated_rate(args, overhead=args.overhead)
            print(f"link: {rate:.0f} Mbit/s", flush=True)
            run_id = time.strftime("%Y%m%dT%H%M%S")
            links = [Shape(rate_mbit=rate), Shape(rate_mbit=None)]
            for round_, variant in rounds(args.variants, args.rounds):
                for shape in links:
                    record = measure(variant, shape, args, round_=round_) | {"run_id": run_id}
                    append_records(args.out, [record])
                    print(f"{variant}, {shape.rate_mbit or 'unshaped'}: {record['samples_per_s']:.1f} samples/s")
        except LinkError as err:
            sys.exit(f"python -m bench.overlap: {err}")
    text = table(read_records(args.out))
    print(text)
    if args.out == RESULTS:
        update_doc(DOC, text, name="overlap")


if __name__ == "__main__":
    main()
