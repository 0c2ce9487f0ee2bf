"""The benchmarks' harness (bench/cases.py): launches that a time limit ends whole, rounds in turn, one precision
table, the tuner's keys from the settings, and the records kept in bench/results/ still rendered."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import time

from bench.cases import PRECISIONS, TrainCase, launch, rounds
from bench.pipeline import main as pipeline_main
from bench.report import main as report_main
from studies.remedies import main as remedies_main
from tests.conftest import REPO
from trainer.config import RECIPE, TUNABLE, Config
from trainer.engine import load_ds_template, precision_of


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_launch_past_its_time_limit_ends_its_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild"
    start = time.monotonic()
    launched = launch(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], timeout_s=1)
    assert launched.timed_out and launched.returncode == -signal.SIGKILL
    assert time.monotonic() - start < 30
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:  # reaped by init once killed
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_launch_stopped_by_sigterm_ends_as_it_chooses():
    saves = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(75)); time.sleep(60)"
    launched = launch([sys.executable, "-c", saves], timeout_s=1, stop=signal.SIGTERM)
    assert launched.timed_out and launched.returncode == 75


def test_rounds_take_the_cases_in_turn():
    assert list(rounds(["a", "b"], 3)) == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]


def test_a_case_command_line_lets_the_user_override_the_case_and_merges_deepspeed_overrides():
    case = TrainCase(
        sweep="s", label="l", ranks=2, options=["--steps", "5", "--deepspeed_overrides", '{"a": {"b": 1, "c": 2}}']
    )
    options = case.train_options(
        ["--config", "debug"],
        steps=10,
        warmup=3,
        run_id="r",
        out="o",
        extra=["--deepspeed_overrides", '{"a": {"c": 3}}'],
    )
    assert options[:2] == ["--config", "debug"] and options[-2:] == ["--deepspeed_overrides", '{"a": {"b": 1, "c": 3}}']
    assert options.index("10") < options.index("5")  # the case's own --steps comes later, and wins
    assert case.launcher()[-4:] == ["--num_gpus", "2", "--module", "bench.train"]


def test_one_precision_table_names_each_project_json_and_its_overrides():
    for name, precision in PRECISIONS.items():
        assert precision_of(load_ds_template(REPO / precision.json)) == name
        assert precision_of(precision.overrides) == name


def test_the_tuner_may_change_the_tunable_keys_only_and_keeps_every_other():
    names = {f.name for f in dataclasses.fields(Config)}
    assert set(TUNABLE) | set(RECIPE) | {"description"} == names and not set(TUNABLE) & set(RECIPE)
    assert {n for n in names if n.startswith("lambda_")} <= set(RECIPE)  # a loss term is never tuned away
    assert {"micro_batch_size", "storage", "backend", "deepspeed_overrides"} <= set(TUNABLE)


def test_the_kept_records_still_render(tmp_path, capsys):
    """bench/results/'s records, through the reports that read them, into copies of the pages."""
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "benchmarks.md"
    shutil.copy(REPO / "docs" / "benchmarks.md", page)
    report_main(["--results", str(REPO / "bench/results/train.jsonl"), "--plots", str(tmp_path), "--doc", str(page)])
    assert "samples/s" in capsys.readouterr().out and list(tmp_path.glob("*.png"))
    pipeline_main(["--report", "--out", str(REPO / "bench/results/pipeline.jsonl"), "--doc", str(page)])
    assert "| crop | case | samples/s (median)" in capsys.readouterr().out
    remedies_main(["--table", "--out", str(REPO / "bench/results/remedies.jsonl")])
    assert "lambda_T=0.1" in capsys.readouterr().out
