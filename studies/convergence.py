"""How soon a model is as good as the base run, per global batch and learning-rate rule: the convergence study.

    python -m studies.convergence                           # the convergence config's ladder, rules and seeds 0, 1
    python -m studies.convergence --multiples 1 16 --rules sqrt linear --epochs_rules half --seeds 0
    python -m studies.convergence --table                   # the table, fit and figure of the records, nothing run

A run is ds_train.py at a multiple of the config's base batch (one rank; larger batches by accumulation, drawn as
that many ranks would draw them), the peak learning rate by a rule (``none``, ``sqrt``, ``linear``; ``+warmupN``: N
warm-up steps instead of the config's), for the base run's steps halved (``half``, the reference's rule) or its
samples (``samples``); validated every ``--validations``-th of the run. Each run is one record in
bench/results/convergence.jsonl: its validation curve against steps, samples and seconds, and its noise scale.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cases import launch
from bench.env import REPO, append_records, environment, read_records
from common.cli import ArgumentParser, output_file
from studies.convergence_report import figure, table
from trainer.config import load_named, parse_value, set_dotted
from trainer.lr_schedule import peak_lr, warmup_applies
from trainer.rundir import METRICS, SUMMARY

RESULTS = REPO / "bench" / "results" / "convergence.jsonl"
RULES = ("none", "sqrt", "linear")
EPOCHS_RULES = ("half", "samples")


@dataclass(frozen=True, kw_only=True)
class Run:
    """One run of the ladder: the batch's multiple of the base, the learning-rate rule, the epochs rule, the seed."""

    multiple: int
    rule: str
    epochs_rule: str
    seed: int

    @property
    def name(self) -> str:
        return f"x{self.multiple}-{self.rule}-{self.epochs_rule}-seed{self.seed}"

    def scaling_and_warmup(self, config_warmup: int) -> tuple[str, int]:
        scaling, _, warmup = self.rule.partition("+warmup")
        return scaling, int(warmup) if warmup else config_warmup


@dataclass(frozen=True, kw_only=True)
class Base:
    """What the config's base run is: its batch, optimizer steps, validations, learning rate and warm-up."""

    batch: int
    lr_base_batch: int  # the batch at which start_lr applies (the config's base_batch_size)
    steps: int
    validations: int
    start_lr: float
    warmup: int
    max_micro: int

    @classmethod
    def of(cls, config: dict[str, Any], *, max_micro: int) -> Base:
        schedule = config["lr_schedule"]
        steps_per_epoch = config["Nsamples"] // config["global_batch_size"]
        return cls(
            batch=config["global_batch_size"],
            lr_base_batch=config["base_batch_size"],
            steps=config["num_epochs"] * steps_per_epoch,
            validations=config["num_epochs"],
            start_lr=schedule["start_lr"],
            warmup=schedule["warmup_steps"],
            max_micro=max_micro,
        )

    def plan(self, run: Run) -> dict[str, Any]:
        """The run's batch, steps, validation interval and learning rate, and ds_train.py's options for them."""
        batch = self.batch * run.multiple
        steps = self.steps // 2 if run.epochs_rule == "half" and run.multiple > 1 else self.steps // run.multiple
        if steps < self.validations or steps % self.validations:
            raise ValueError(f"{run.name}: {steps} steps do not split into {self.validations} validations")
        micro = min(batch, self.max_micro)
        scaling, warmup = ("none", 0) if run.rule == "base" else run.scaling_and_warmup(self.warmup)
        # warm-up only where the rule scales the learning rate up, over a quarter of a short run's steps at most
        warmup = min(warmup, steps // 4) if warmup_applies(scaling, batch, self.lr_base_batch) else 0
        options = ["--global_batch_size", str(batch), "--micro_batch_size", str(micro), "--accumulate_as_ranks", "true"]
        options += ["--num_epochs", str(self.validations), "--Nsamples", str(steps // self.validations * batch)]
        if run.rule != "base":  # the base run is the config's own: no rule scales its batch
            options += ["--lr_schedule.scaling", scaling, "--lr_schedule.warmup_steps", str(warmup)]
        peak = peak_lr(self.start_lr, scaling, batch, base_batch=self.lr_base_batch)
        return {"global_batch": batch, "steps": steps, "peak_lr": peak, "warmup_steps": warmup, "options": options}


def curve(run_dir: Path, *, batch: int) -> list[dict[str, float]]:
    """The run's validations: loss against optimizer steps, samples and seconds since the start."""
    records = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]
    return [
        {"step": r["step"], "samples": r["step"] * batch, "time_s": r["time_s"], "loss": r["loss/valid"]}
        for r in records
        if "loss/valid" in r
    ]


def noise_history(run_dir: Path) -> list[list[float]]:
    records = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]
    return [[r["step"], r["noise/b_simple"]] for r in records if "noise/b_simple" in r]


def run(config: str, base: Base, spec: Run, *, out_dir: Path, settings: list[str]) -> dict[str, Any]:
    """Train the run (unless its directory holds a finished one) and its record."""
    plan = base.plan(spec)
    run_dir = out_dir / f"{config}-{spec.name}"
    summary_path = run_dir / SUMMARY
    if not (summary_path.exists() and json.loads(summary_path.read_text()).get("finished")):
        options = ["--config", config, *settings, "--seed", str(spec.seed), "--run_dir", str(run_dir), *plan["options"]]
        command = [sys.executable, "ds_train.py", *options, *(["--overwrite"] if run_dir.exists() else [])]
        print(f"{spec.name}: {' '.join(plan['options'])}", flush=True)
        launched = launch(command, capture=False)
        if launched.returncode != 0:
            sys.exit(f"failed (exit status {launched.returncode}): {' '.join(command)}")
    summary = json.loads(summary_path.read_text())
    return {
        "bench": "convergence",
        "config": config,
        "multiple": spec.multiple,
        "rule": spec.rule,
        "epochs_rule": spec.epochs_rule,
        "seed": spec.seed,
        "base_batch": base.batch,
        "base_steps": base.steps,
        **{k: v for k, v in plan.items() if k != "options"},
        "run_dir": str(run_dir),
        "curve": curve(run_dir, batch=plan["global_batch"]),
        "b_simple": noise_history(run_dir),
        "final_val_loss": summary["final_val_loss"],
        "train_wall_s": summary["wall_s"],
        "samples_per_s": summary["samples_per_s"],
        "world_size": summary["world_size"],
        "micro_batch": summary["micro_batch"],
        "accumulation": summary["accumulation"],
    }


def runs(args: Any) -> list[Run]:
    """The ladder: the base run first (multiple 1 has no rule), then every multiple, rule and epochs rule."""
    planned = []
    for seed in args.seeds:
        planned.append(Run(multiple=1, rule="base", epochs_rule="base", seed=seed))
        for multiple in (m for m in args.multiples if m > 1):
            planned += [
                Run(multiple=multiple, rule=rule, epochs_rule=epochs, seed=seed)
                for epochs in args.epochs_rules
                for rule in args.rules
            ]
    return planned


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m studies.convergence", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="convergence")
    parser.add_argument("--multiples", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--rules", nargs="+", default=list(RULES), help="none, sqrt or linear, each with +warmupN")
    parser.add_argument("--epochs_rules", nargs="+", choices=EPOCHS_RULES, default=list(EPOCHS_RULES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--max_micro", type=int, default=32, help="the largest micro-batch; above it, accumulation")
    parser.add_argument("--out_dir", type=Path, default=REPO / "runs" / "convergence", help="where the runs go")
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    parser.add_argument("--figure", type=output_file, default=REPO / "docs" / "convergence.png")
    parser.add_argument("--table", action="store_true", help="only the table, fit and figure of the results file")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config keys set in every run")
    args = parser.parse_args(argv)
    config = load_named(REPO / "ds_configs" / "UNet.yaml", args.config)
    settings = []
    for pair in args.set:
        key, sep, value = pair.partition("=")
        if not sep:
            parser.error(f"--set {pair}: expected KEY=VALUE")
        set_dotted(config, key, parse_value(value))
        settings += [f"--{key}", value]
    base = Base.of(config, max_micro=args.max_micro)
    planned = runs(args)
    if not args.table:
        for spec in planned:
            try:
                base.plan(spec)
                if spec.rule != "base" and spec.scaling_and_warmup(base.warmup)[0] not in RULES:
                    raise ValueError(f"rule {spec.rule}: expected one of {', '.join(RULES)}, each with +warmupN")
            except ValueError as err:
                parser.error(str(err))
        env = environment()
        for spec in planned:
            record = run(args.config, base, spec, out_dir=args.out_dir, settings=settings)
            append_records(args.out, [record | {"settings": args.set} | env])
    records = [r for r in read_records(args.out) if r["config"] == args.config and r.get("settings", []) == args.set]
    print(table(records))
    figure(records, args.figure)
    print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
