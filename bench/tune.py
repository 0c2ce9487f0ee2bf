"""Config tuning, measured: the fastest settings of a named config on this machine, written as a config.

    python -m bench.tune --config debug --budget_s 900              # writes debug_tuned.yaml (+ .json)
    python ds_train.py --yaml_config debug_tuned.yaml --config debug_tuned

Each candidate is a run of ``python -m bench.train --modes full`` (the real data path, its warm-up discarded) in a
process of its own, so that a candidate that runs out of memory or fails costs that candidate only. The search is
greedy, one group of settings at a time, each candidate measured against the settings chosen so far in
interleaved rounds (a, b, c, a, b, c) whose median counts:

1. ``micro_batch_size``: the divisors of the per-rank batch, largest first, with gradient accumulation keeping the
   global batch (on a GPU the largest that fits: those that run out of memory are recorded and skipped);
2. precision: fp32, bf16 and fp16 where the device has them (bf16 and fp16 as DeepSpeed overrides of the config's
   JSON, which keeps its optimizer and ZeRO settings);
3. on a CPU, torch threads per rank, then data threads; on a GPU, the fast paths (channels-last, cuDNN autotuning
   and its timing of every algorithm, torch.compile) one at a time, and with several ranks the ZeRO stage;
4. storage (lazy, host, device) and backend (torch, DALI where installed).

A setting replaces the one chosen so far only when it is faster by more than ``--margin`` (3% by default), so that
noise does not change a config. The recipe never changes: global batch, learning-rate schedule, model, data and
loss are the named config's (checked before the file is written). The last round measures the named config and the
tuned one in turn; where the tuned one is not faster, the named config's settings are written. The tuned config is
written as ``NAME_tuned`` in ``--out`` with its candidates' samples/s in comments, and every candidate's record in
the companion JSON (``--out`` with .json): samples/s per round, and why the losers lost (slower, failed, out of
memory, not available here, not measured within the budget). Where no candidate was measured at all (a budget
shorter than one run, or every run failed) nothing is written: one error line says why, and the exit status is 1.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.env import REPO, environment, read_records
from bench.sweep import SweepRun, command
from common.cli import ArgumentParser, output_file
from common.files import write_text_atomically
from common.hold import HeldError, hold_file
from pipeline.loaders import dali_installed, resolve_backend
from trainer.config import (
    Config,
    build_config,
    channels_last_on,
    config_parser,
    load_named,
    parse_config_options,
    parse_value,
    set_dotted,
)
from trainer.engine import load_ds_template, merge_settings
from trainer.errors import ConfigError

# The keys a tuned config may change: how the work is done, never what is computed.
TUNABLE = (
    "micro_batch_size",
    "deepspeed_overrides",
    "cpu_threads",
    "num_data_workers",
    "storage",
    "backend",
    "channels_last",
    "cudnn_benchmark",
    "cudnn_benchmark_limit",
    "compile",
    "compile_mode",
)
# The recipe: what a tuned config must keep (compared on the resolved configs before writing).
RECIPE = (
    "global_batch_size",
    "base_batch_size",
    "lr_schedule",
    "num_epochs",
    "Nsamples",
    "Nsamples_val",
    "data_size",
    "unet_width",
    "unet_depth",
    "weight_init",
    "lambda_rho",
    "lambda_pk",
    "seed",
    "train_path",
    "val_path",
)
PRECISIONS = {
    "fp32": {"fp16": {"enabled": False}, "bf16": {"enabled": False}},
    "bf16": {"fp16": {"enabled": False}, "bf16": {"enabled": True}},
    # fp16 takes ds_fp16.json's loss-scaling settings
    "fp16": {"fp16": load_ds_template(REPO / "ds_configs" / "ds_fp16.json")["fp16"], "bf16": {"enabled": False}},
}
STAGES = ("micro_batch", "precision", "threads", "data_threads", "fast_paths", "zero", "storage", "backend")


@dataclass(kw_only=True)
class Candidate:
    stage: str
    label: str
    settings: dict[str, Any]  # config keys set on top of the settings chosen so far
    rates: list[float] = field(default_factory=list)
    status: str = "pending"  # measured, failed, out of memory, not available here, not measured
    reason: str = ""
    wall_s: float = 0.0

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    def record(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "label": self.label,
            "settings": self.settings,
            "samples_per_s": self.median,
            "samples_per_s_runs": self.rates,
            "status": self.status,
            "reason": self.reason,
            "wall_s": round(self.wall_s, 1),
        }


def apply_settings(raw: dict[str, Any], *settings: dict[str, Any]) -> dict[str, Any]:
    """A config's mapping with tuned settings applied in turn (DeepSpeed overrides merged key by key)."""
    if unknown := {key for s in settings for key in s} - set(TUNABLE):
        raise ValueError(f"not tunable: {', '.join(sorted(unknown))}")
    merged = dict(raw)
    for each in settings:
        for key, value in each.items():
            merged[key] = merge_settings(merged.get(key) or {}, value) if key == "deepspeed_overrides" else value
    return merged


def _precision(ds_config: dict[str, Any]) -> str:
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"


def _bf16_supported(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_bf16_supported())


class Tuner:
    """Measures candidates with bench.train within a deadline and keeps the fastest settings."""

    def __init__(self, args: Any, cfg: Config, raw: dict[str, Any]) -> None:
        self.args, self.cfg, self.raw = args, cfg, raw
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.deadline = time.monotonic() + args.budget_s
        self.chosen: dict[str, Any] = {}
        self.candidates: list[Candidate] = []
        self.run_id = time.strftime("%Y%m%dT%H%M%S")
        self._scratch = tempfile.TemporaryDirectory(prefix="tune-")  # removed when the tuner goes, or at exit
        scratch = Path(self._scratch.name)
        self.results = scratch / "records.jsonl"
        # the named config with the command line's overrides, as the candidates' runs read it
        self.named = scratch / "named.yaml"
        self.named.write_text(yaml.safe_dump({args.config: raw}, sort_keys=False))
        self.longest_run_s = 0.0
        self.final_rounds = max(args.repeats, 2)

    # -- the settings of each stage ------------------------------------------------------------------------
    def stage_candidates(self, stage: str) -> list[Candidate] | str:
        """The stage's candidates, the settings chosen so far among them (as no settings), or why the stage does not
        apply here."""
        cfg, gpu, ranks = self.current(), self.device_type == "cuda", self.args.ranks
        template = load_ds_template(cfg.deepspeed_config, cfg.deepspeed_overrides)

        def options(key: str, values: list[Any], now: Any, *, label: str, setting=lambda v: v) -> list[Candidate]:
            return [
                Candidate(stage=stage, label=label.format(v), settings={} if v == now else {key: setting(v)})
                for v in values
            ]

        if stage == "micro_batch":
            per_rank = cfg.global_batch_size // ranks
            sizes = [m for m in range(per_rank, 0, -1) if per_rank % m == 0][: self.args.micro_batches]
            now = cfg.micro_batch_size or per_rank
            return [
                Candidate(
                    stage=stage,
                    label=f"micro {m} x accumulation {per_rank // m}",
                    settings={} if m == now else {"micro_batch_size": m},
                )
                for m in sorted(set(sizes) | {now}, reverse=True)
            ]
        if stage == "precision":
            found = options(
                "deepspeed_overrides", list(PRECISIONS), _precision(template), label="{}", setting=PRECISIONS.get
            )
            for c in found:
                if c.label == "fp16" and not gpu:
                    c.status, c.reason = "not available here", "fp16 training needs a GPU (DeepSpeed's CPU accelerator)"
                elif c.label == "bf16" and not _bf16_supported(self.device_type):
                    c.status, c.reason = "not available here", f"this {self.device_type} has no bf16 support"
            return found
        if stage == "threads":
            if gpu:
                return "on a GPU the threads do not bound the step"
            cores = max(1, len(os.sched_getaffinity(0)) // ranks)
            now = cfg.cpu_threads or cores
            return options(
                "cpu_threads", sorted({cores, max(1, cores // 2), now}, reverse=True), now, label="{} torch threads"
            )
        if stage == "data_threads":
            if cfg.storage == "device":
                return "with storage device the crops are cut by the training device, not by data threads"
            now = cfg.num_data_workers
            return options("num_data_workers", sorted({1, 2, 4, now}), now, label="{} data threads")
        if stage == "fast_paths":
            if not gpu:
                return "channels-last, cuDNN autotuning and torch.compile are GPU fast paths"
            found = [Candidate(stage=stage, label="as chosen so far", settings={})]
            # what each switch is on a GPU now (null: channels_last and cudnn_benchmark on), then its opposite
            now = {
                "channels_last": channels_last_on(cfg, "cuda"),
                "cudnn_benchmark": cfg.cudnn_benchmark is not False,
                "compile": cfg.compile,
            }
            for key, value in now.items():
                found.append(Candidate(stage=stage, label=f"{key} {not value}", settings={key: not value}))
            if now["cudnn_benchmark"] and cfg.cudnn_benchmark_limit != 0:  # cuDNN times every algorithm it has
                found.append(
                    Candidate(stage=stage, label="cudnn_benchmark_limit 0", settings={"cudnn_benchmark_limit": 0})
                )
            return found
        if stage == "zero":
            if not gpu or ranks == 1:
                return "ZeRO partitions state across ranks: tuned with several GPU ranks only"
            now = template.get("zero_optimization", {}).get("stage", 0)
            return options(
                "deepspeed_overrides",
                [0, 1, 2],
                now,
                label="ZeRO {}",
                setting=lambda v: {"zero_optimization": {"stage": v}},
            )
        if stage == "storage":
            return options("storage", ["lazy", "host", "device"], cfg.storage, label="storage {}")
        if stage == "backend":
            found = options(
                "backend",
                ["torch", "dali"],
                resolve_backend(cfg.backend, self.device_type, cfg.storage),
                label="backend {}",
            )
            if not dali_installed():
                found[1].status, found[1].reason = "not available here", "NVIDIA DALI is not installed"
            return found
        raise ValueError(stage)

    def current(self, extra: dict[str, Any] | None = None) -> Config:
        return build_config(self.mapping(extra), {})

    def mapping(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The named config's mapping with the settings chosen so far (and ``extra``) applied."""
        return apply_settings(self.raw, self.chosen, extra or {})

    # -- measuring ----------------------------------------------------------------------------------------------
    def options(self, c: Candidate, round_: int) -> list[str]:
        mapping = self.mapping(c.settings)
        overrides = []
        for key in TUNABLE:
            if key in mapping:
                overrides += [f"--{key}", json.dumps(mapping[key])]
        return [
            *["--yaml_config", str(self.named), "--config", self.args.config],
            *["--modes", "full", "--steps", str(self.args.steps), "--warmup", str(self.warmup(mapping))],
            *["--sweep", "tune", "--case", f"{c.stage}: {c.label}", "--run_id", self.run_id],
            *["--repeat", str(round_), "--out", str(self.results)],
            *overrides,
        ]

    def warmup(self, mapping: dict[str, Any]) -> int:
        # torch.compile compiles in its first steps: they are not the speed it trains at
        return max(self.args.warmup, 10) if mapping.get("compile") else self.args.warmup

    def run(self, c: Candidate, round_: int) -> None:
        # The stages leave the final comparison its runs: two configs, their rounds, at the longest run seen.
        reserve = 0.0 if c.stage == "final" else 2 * self.final_rounds * self.longest_run_s
        remaining = self.deadline - reserve - time.monotonic()
        if remaining <= max(self.longest_run_s, 1.0):
            c.status = "not measured"
            c.reason = f"the budget ({self.args.budget_s:g} s) was spent" + (
                ", what was left kept for the final comparison" if reserve else ""
            )
            return
        cmd = [
            *command(
                SweepRun(sweep="tune", label=c.label, ranks=self.args.ranks, modes=["full"]),
                "deepspeed",
                self.args.ranks,
            )
        ]
        cmd += self.options(c, round_)
        print(f"[{c.stage}] {c.label} (round {round_ + 1})", flush=True)
        start = time.monotonic()
        # a session of its own: the launcher's ranks stop with it when the budget runs out
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            c.wall_s += time.monotonic() - start
            c.status, c.reason = "not measured", f"the budget ({self.args.budget_s:g} s) ran out during its run"
            return
        result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        elapsed = time.monotonic() - start
        c.wall_s += elapsed
        self.longest_run_s = max(self.longest_run_s, elapsed)
        case = f"{c.stage}: {c.label}"
        records = [
            r
            for r in (read_records(self.results) if self.results.exists() else [])
            if r.get("run_id") == self.run_id and r.get("case") == case and r.get("repeat") == round_
        ]
        if result.returncode != 0 or not records:
            c.status, c.reason = _failure(result)
            return
        c.rates.append(records[-1]["samples_per_s"])
        c.status = "measured"

    def stage(self, stage: str, found: list[Candidate] | str | None = None) -> None:
        """Measure the stage's candidates in interleaved rounds and keep the fastest settings."""
        found = self.stage_candidates(stage) if found is None else found
        if isinstance(found, str):
            print(f"[{stage}] skipped: {found}", flush=True)
            self.candidates.append(
                Candidate(stage=stage, label="(stage skipped)", settings={}, status="not applicable", reason=found)
            )
            return
        if not any(c.settings == {} for c in found):
            found.insert(0, Candidate(stage=stage, label="as chosen so far", settings={}))
        self.candidates += found
        for round_ in range(self.args.repeats):
            for c in found:
                if c.status in ("pending", "measured"):
                    self.run(c, round_)
        self.decide(found)

    def decide(self, found: list[Candidate]) -> None:
        """The fastest measured candidate becomes the settings chosen so far, if faster by more than the margin."""
        incumbent = next(c for c in found if c.settings == {})
        measured = [c for c in found if c.median is not None]
        if incumbent.median is None:
            for c in measured:
                c.status, c.reason = "not chosen", "the settings chosen so far were not measured to compare"
            return
        best = max(measured, key=lambda c: c.median)
        if best.median <= incumbent.median * (1 + self.args.margin):
            best = incumbent  # within the noise: keep what was chosen
        for c in measured:
            ratio = f"{c.median:.1f} against {best.median:.1f} samples/s ({c.median / best.median - 1:+.1%})"
            if c is best:
                c.status, c.reason = "chosen", ""
            elif c.median <= best.median:
                c.status, c.reason = "slower", ratio
            else:
                c.status, c.reason = "within the margin", f"{ratio}: not {self.args.margin:.0%} faster"
        self.chosen = {k: v for k, v in self.mapping(best.settings).items() if k in TUNABLE and self.raw.get(k) != v}

    def final(self) -> tuple[Candidate, Candidate]:
        """The named config and the tuned one, in turn, with the rounds that remain of the repeats."""
        tuned_settings = dict(self.chosen)
        self.chosen = {}
        original = Candidate(stage="final", label="named config", settings={})
        # nothing measured faster: the tuned config is the named one, measured once
        tuned = Candidate(stage="final", label="tuned config", settings=tuned_settings) if tuned_settings else original
        measured = [original] if tuned is original else [original, tuned]
        self.candidates += measured
        for round_ in range(self.final_rounds):
            for c in measured:
                if c.status in ("pending", "measured"):
                    self.run(c, round_)
        if tuned is original:
            if original.median is not None:
                original.status, original.reason = "chosen", "no setting was measured faster: the named config's own"
            return original, tuned
        # a named config that does not run here (its run failed) loses to a tuned one that does
        keep = tuned.median is not None and (original.median is None or tuned.median >= original.median)
        self.chosen = tuned_settings if keep else {}
        if keep and original.median is not None:
            original.status, tuned.status = "slower", "chosen"
        elif not keep and tuned.median is not None:
            tuned.status = "not chosen"
            tuned.reason = "not measured faster than the named config: the named config's settings are written"
        return original, tuned


def _failure(result: subprocess.CompletedProcess) -> tuple[str, str]:
    text = (result.stderr or "") + (result.stdout or "")
    if "out of memory" in text.lower() or "OutOfMemoryError" in text or result.returncode in (-9, 137):
        return "out of memory", "out of memory" + (" (killed)" if result.returncode in (-9, 137) else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return "failed", (errors or lines or [f"exit status {result.returncode}"])[-1][:300]


def _rate(c: Candidate) -> str:
    return "not measured" if c.median is None else f"{c.median:.1f} samples/s"


def check_recipe(original: Config, tuned: Config) -> None:
    """The tuned config computes what the named one does; an internal error otherwise."""
    changed = [key for key in RECIPE if getattr(original, key) != getattr(tuned, key)]
    if changed:
        raise AssertionError(f"the tuner changed the recipe: {', '.join(changed)}")


def write_outputs(tuner: Tuner, original: Candidate, tuned: Candidate, *, out: Path, spent_s: float) -> str:
    name = f"{tuner.args.config}_tuned"
    mapping = tuner.mapping()
    env = environment()
    machine = env["device"] if env["device"] != "cpu" else f"{env['cpu']}, {env['cores']} cores"
    if tuned is original:
        rates = f"no setting measured faster than its own ({_rate(original)})"
    else:
        rates = f"{_rate(tuned)} against {_rate(original)} for {tuner.args.config}"
    mapping["description"] = f"{tuner.args.config} tuned by bench.tune on {machine}: {rates}"
    check_recipe(build_config(dict(tuner.raw), {}), build_config(mapping, {}))
    lines = [
        f"# {name}: written by python -m bench.tune --config {tuner.args.config} on {env['host']} ({machine}),",
        f"# {env['time']}, {tuner.args.ranks} rank(s), budget {tuner.args.budget_s:g} s (spent {spent_s:.0f} s).",
        f"# Use: python ds_train.py --yaml_config {out} --config {name}",
        "# Candidates (bench.train --modes full, median samples/s over interleaved rounds; records in "
        f"{out.with_suffix('.json').name}):",
    ]
    for c in tuner.candidates:
        rate = f"{c.median:8.1f}" if c.median is not None else "       -"
        lines.append(f"#   {c.stage:<12} {c.label:<34} {rate}  {c.status}{': ' + c.reason if c.reason else ''}")
    text = "\n".join(lines) + "\n" + yaml.safe_dump({name: mapping}, sort_keys=False, width=120)
    write_text_atomically(out, text)
    record = {
        "config": tuner.args.config,
        "tuned": name,
        "settings": tuner.chosen,
        "samples_per_s": {"named": original.median, "tuned": tuned.median},
        "budget_s": tuner.args.budget_s,
        "spent_s": round(spent_s, 1),
        "ranks": tuner.args.ranks,
        "steps": tuner.args.steps,
        "warmup": tuner.args.warmup,
        "repeats": tuner.args.repeats,
        "margin": tuner.args.margin,
        "candidates": [c.record() for c in tuner.candidates],
        **{k: env[k] for k in ("host", "device", "cpu", "cores", "torch", "deepspeed", "commit", "time")},
    }
    write_text_atomically(out.with_suffix(".json"), json.dumps(record, indent=1) + "\n")
    return name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = config_parser("python -m bench.tune", __doc__.split("\n\n")[0], argv)
    parser.epilog = (
        "Config options (--key VALUE) change the named config before it is tuned, and go into the tuned config: "
        "point it at other data, say. " + (parser.epilog or "")
    )
    parser.add_argument("--budget_s", type=float, default=900.0, help="wall-clock budget of the measurements")
    parser.add_argument("--out", type=output_file, help="the tuned config's file (default: NAME_tuned.yaml)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="in this order")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per candidate (the deepspeed launcher)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps discarded per run (10 with compile)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds per stage; the median counts")
    parser.add_argument("--margin", type=float, default=0.03, help="how much faster a change must be to be taken")
    parser.add_argument("--micro_batches", type=int, default=4, help="micro-batch sizes tried, largest first")
    parser.add_argument(
        "--try",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more candidate, measured after the stages (keys: " + ", ".join(TUNABLE) + ")",
    )
    args, overrides = parse_config_options(parser, argv)
    out = args.out or Path(f"{args.config}_tuned.yaml")
    if out.suffix not in (".yaml", ".yml"):
        parser.error(f"--out must name a .yaml file, got {out}")
    try:
        hold = hold_file(out, "wait for it to end, or choose another --out")
    except HeldError as err:
        parser.error(str(err))
    with hold:
        return _tune(parser, args, overrides, out=out)


def _tune(parser: ArgumentParser, args: Namespace, overrides: dict[str, str], *, out: Path) -> int:
    if not args.overwrite and (out.exists() or out.with_suffix(".json").exists()):
        parser.error(f"{out} (or its .json) exists: pass --overwrite to replace it")
    if min(args.budget_s, args.repeats, args.steps, args.ranks, args.micro_batches) <= 0 or args.margin < 0:
        parser.error(
            "--budget_s, --repeats, --steps, --ranks and --micro_batches must be positive, --margin not negative"
        )
    extra = []
    for text in args.extra:
        settings = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in TUNABLE:
                parser.error(f"--try {text}: expected KEY=VALUE with KEY one of {', '.join(TUNABLE)}")
            settings[key.strip()] = parse_value(value.strip())
        extra.append(Candidate(stage="tried", label=text, settings=settings))
    try:
        raw = load_named(args.yaml_config, args.config)
        for key, value in overrides.items():
            set_dotted(raw, key, parse_value(value))
        cfg = build_config(dict(raw), {})
        if cfg.global_batch_size % args.ranks:
            raise ConfigError(f"global_batch_size {cfg.global_batch_size} is not divisible by {args.ranks} ranks")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.monotonic()
    tuner = Tuner(args, cfg, raw)
    for stage in args.stages:
        tuner.stage(stage)
    if extra:
        tuner.stage("tried", extra)
    original, tuned = tuner.final()
    spent = time.monotonic() - start
    if all(c.median is None for c in tuner.candidates):
        # why the candidates that could run here were not measured
        tried = [c for c in tuner.candidates if c.status not in ("not applicable", "not available here")]
        reasons = sorted({f"{c.status}: {c.reason}" if c.reason else c.status for c in tried or tuner.candidates})
        print(
            f"error: bench.tune measured no candidate in {spent:.0f} s of a {args.budget_s:g} s budget, so {out} "
            f"is not written ({'; '.join(reasons)}): raise --budget_s, or see why the runs failed",
            file=sys.stderr,
        )
        return 1
    name = write_outputs(tuner, original, tuned, out=out, spent_s=spent)
    print(
        f"wrote {out} ({name}) and {out.with_suffix('.json')}: {_rate(tuned)} against {_rate(original)} for "
        f"{args.config}, in {spent:.0f} s of a {args.budget_s:g} s budget",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
