"""Config tuning, measured: the fastest settings of a named config on this machine, written as a config.

    python -m bench.tune --config debug --budget_s 900              # writes debug_tuned.yaml (+ .json)
    python ds_train.py --yaml_config debug_tuned.yaml --config debug_tuned

Each candidate is a ``bench.train --modes full`` run in a process of its own, measured against the settings chosen so
far in interleaved rounds; only the config's tunable keys change, never its recipe. docs/benchmarks.md (Tuning a
config) tells the stages, the margin, the budget and what is written.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.cases import Launched, TrainCase, launch, rounds
from bench.env import environment, read_records
from bench.tune_stages import STAGES, Candidate
from common.cli import ArgumentParser, output_file
from common.files import write_text_atomically
from common.hold import HeldError, hold_file
from common.outputs import OutputError, claim_files, refuse_inputs
from trainer.config import (
    RECIPE,
    TUNABLE,
    Config,
    build_config,
    config_parser,
    load_named,
    parse_config_options,
    parse_value,
    set_dotted,
)
from trainer.engine import load_ds_template, merge_settings
from trainer.errors import ConfigError


def apply_settings(raw: dict[str, Any], *settings: dict[str, Any]) -> dict[str, Any]:
    """A config's mapping with tuned settings applied in turn (DeepSpeed overrides merged key by key)."""
    if unknown := {key for s in settings for key in s} - set(TUNABLE):
        raise ValueError(f"not tunable: {', '.join(sorted(unknown))}")
    merged = dict(raw)
    for each in settings:
        for key, value in each.items():
            merged[key] = merge_settings(merged.get(key) or {}, value) if key == "deepspeed_overrides" else value
    return merged


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

    def stage_candidates(self, stage: str) -> list[Candidate] | str:
        """The stage's candidates, the settings chosen so far among them (as no settings), or why the stage does not
        apply here."""
        cfg = self.current()
        return STAGES[stage](self, cfg, load_ds_template(cfg.deepspeed_config, cfg.deepspeed_overrides))

    def current(self, extra: dict[str, Any] | None = None) -> Config:
        return build_config(self.mapping(extra), {})

    def mapping(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The named config's mapping with the settings chosen so far (and ``extra``) applied."""
        return apply_settings(self.raw, self.chosen, extra or {})

    # -- measuring ----------------------------------------------------------------------------------------------
    def case(self, c: Candidate, round_: int) -> tuple[TrainCase, list[str]]:
        """The candidate's run of bench.train (its tunable settings as options) and that run's options."""
        mapping = self.mapping(c.settings)
        overrides = [item for key in TUNABLE if key in mapping for item in (f"--{key}", json.dumps(mapping[key]))]
        case = TrainCase(
            sweep="tune", label=f"{c.stage}: {c.label}", ranks=self.args.ranks, options=overrides, repeat=round_
        )
        base = ["--yaml_config", str(self.named), "--config", self.args.config]
        warmup = max(self.args.warmup, 10) if mapping.get("compile") else self.args.warmup  # compiling is not speed
        return case, case.train_options(
            base, steps=self.args.steps, warmup=warmup, run_id=self.run_id, out=str(self.results)
        )

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
        case, options = self.case(c, round_)
        print(f"[{c.stage}] {c.label} (round {round_ + 1})", flush=True)
        launched = launch([*case.launcher(ranks_per_node=self.args.ranks), *options], timeout_s=remaining)
        c.wall_s += launched.wall_s
        if launched.timed_out:
            c.status, c.reason = "not measured", f"the budget ({self.args.budget_s:g} s) ran out during its run"
            return
        self.longest_run_s = max(self.longest_run_s, launched.wall_s)
        records = [
            r
            for r in (read_records(self.results) if self.results.exists() else [])
            if r.get("run_id") == self.run_id and r.get("case") == case.label and r.get("repeat") == round_
        ]
        if launched.returncode != 0 or not records:
            c.status, c.reason = _failure(launched)
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
        self.measure(found, self.args.repeats)
        self.decide(found)

    def measure(self, found: list[Candidate], repeats: int) -> None:
        for round_, c in rounds(found, repeats):
            if c.status in ("pending", "measured"):
                self.run(c, round_)

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
        self.measure(measured, self.final_rounds)
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


def _failure(launched: Launched) -> tuple[str, str]:
    text, killed = launched.output, launched.returncode in (-9, 137)
    if "out of memory" in text.lower() or "OutOfMemoryError" in text or killed:
        return "out of memory", "out of memory" + (" (killed)" if killed else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return "failed", (errors or lines or [f"exit status {launched.returncode}"])[-1][:300]


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
    try:
        refuse_inputs([out, out.with_suffix(".json")], [args.yaml_config])
        advice = "choose another --out"
        claim_files([out, out.with_suffix(".json")], by="bench.tune", overwrite=args.overwrite, advice=advice)
    except OutputError as err:
        parser.error(str(err))
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
