"""bench.tune on the tiny config: real bench.train runs per candidate, a budget, a failing candidate, and a written
config that the trainer accepts and that trains as the named config does."""

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml

from bench.tune import RECIPE, Tuner, apply_settings
from common.outputs import mark
from tests.conftest import REPO, run_train, single_process_env
from trainer.config import DEFAULT_YAML, build_config, load_named

TINY = {
    "data_size": 16,
    "unet_depth": 4,
    "unet_width": 4,
    "Nsamples": 64,
    "Nsamples_val": 16,
    "num_epochs": 1,
    "global_batch_size": 8,
    "base_batch_size": 8,
    "log_every_steps": 1,
    "num_data_workers": 1,
    "synthetic": {"train_box_size": 32, "val_box_size": 32, "seed": 3},
    "lr_schedule": {"scaling": "none", "start_lr": 1e-2, "end_lr": 0.0, "warmup_steps": 0},
}
QUICK = ["--steps", "2", "--warmup", "1", "--repeats", "1", "--micro_batches", "2"]


@pytest.fixture(scope="module")
def named(tiny_data, tmp_path_factory):
    """A YAML file naming the tiny config 'tiny' (the debug config, made small, on the tiny boxes)."""
    mapping = {**load_named(DEFAULT_YAML, "debug"), **TINY}
    mapping.update(train_path=str(tiny_data["train"]), val_path=str(tiny_data["val"]))
    path = tmp_path_factory.mktemp("named") / "tiny.yaml"
    path.write_text(yaml.safe_dump({"tiny": mapping}))
    return path


def tune(named, out, *options, timeout=600):
    command = [sys.executable, "-m", "bench.tune", "--yaml_config", str(named), "--config", "tiny", "--out", str(out)]
    return subprocess.run(
        [*command, *options], cwd=REPO, env=single_process_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def tuned(named, tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned") / "tiny_tuned.yaml"
    # micro-batch 3 does not divide the batch of 8: a candidate whose run fails
    result = tune(named, out, "--stages", "micro_batch", "--try", "micro_batch_size=3", "--budget_s", "300", *QUICK)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, json.loads(out.with_suffix(".json").read_text()), result


def test_every_candidate_is_measured_or_says_why_not(tuned):
    _, record, result = tuned
    by_label = {c["label"]: c for c in record["candidates"]}
    for label in ("micro 8 x accumulation 1", "micro 4 x accumulation 2"):
        assert by_label[label]["samples_per_s"] > 0 and by_label[label]["status"] in (
            "chosen",
            "slower",
            "within the margin",
        )
    failed = by_label["micro_batch_size=3"]
    assert failed["status"] == "failed" and "not a multiple of micro_batch_size 3" in failed["reason"]
    assert failed["samples_per_s"] is None
    named, tuned_ = record["samples_per_s"]["named"], record["samples_per_s"]["tuned"]
    assert named > 0 and tuned_ > 0
    assert f"{tuned_:.1f} samples/s against {named:.1f} samples/s" in result.stdout


def test_the_written_config_loads_and_keeps_the_recipe(tuned, named):
    out, record, _ = tuned
    written = build_config(load_named(out, "tiny_tuned"), {})
    original = build_config(load_named(named, "tiny"), {})
    assert all(getattr(written, key) == getattr(original, key) for key in RECIPE)
    text = out.read_text()
    assert "micro_batch_size=3" in text and "failed" in text  # the losers are in the file's comments
    assert record["samples_per_s"]["tuned"] >= record["samples_per_s"]["named"] or record["settings"] == {}


def test_the_budget_is_respected(named, tmp_path):
    out = tmp_path / "short.yaml"
    start = time.monotonic()
    result = tune(named, out, "--stages", "micro_batch", "precision", "--budget_s", "20", *QUICK)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["spent_s"] <= 20 + 5  # a run cut at the deadline is killed, its ranks with it
    assert elapsed < 20 + 30  # and the tuner's own start and writing
    assert any(c["status"] == "not measured" for c in record["candidates"])
    build_config(load_named(out, "tiny_tuned"), {})  # what it writes then still loads


def test_a_budget_that_measures_nothing_writes_nothing(named, tmp_path):
    """A budget shorter than one run measures no candidate: an error line, status 1, and no tuned config that is
    the named one unmeasured."""
    out = tmp_path / "none.yaml"
    result = tune(named, out, "--stages", "micro_batch", "--budget_s", "1", *QUICK)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "measured no candidate" in result.stderr and "the budget (1 s) was spent" in result.stderr
    assert not out.exists() and not out.with_suffix(".json").exists()


def test_a_tuned_micro_batch_trains_to_the_same_losses(named, tmp_path):
    """The settings the tuner writes (here micro-batch 2 with gradient accumulation 4 for the batch of 8, and one
    torch thread) train as the named config does: the same losses, to float32 rounding, at every step."""
    tuned = apply_settings(load_named(named, "tiny"), {"micro_batch_size": 2, "cpu_threads": 1})
    path = tmp_path / "tuned.yaml"
    path.write_text(yaml.safe_dump({"tiny_tuned": tuned}))
    runs = {}
    for name, yaml_file in (("tiny", named), ("tiny_tuned", path)):
        runs[name] = tmp_path / name
        result = run_train(["--yaml_config", str(yaml_file), "--config", name, "--run_dir", str(runs[name])])
        assert result.returncode == 0, result.stderr[-2000:]
    losses = {name: _losses(run) for name, run in runs.items()}
    assert len(losses["tiny"]) == 8  # 64 samples in steps of 8
    assert losses["tiny_tuned"] == pytest.approx(losses["tiny"], rel=1e-4)
    summaries = [json.loads((run / "summary.json").read_text()) for run in runs.values()]
    assert summaries[1]["final_val_loss"] == pytest.approx(summaries[0]["final_val_loss"], rel=1e-4)
    with pytest.raises(ValueError, match="not tunable: unet_width"):
        apply_settings(load_named(named, "tiny"), {"unet_width": 8})


def test_bad_options_are_refused(named, tmp_path):
    result = tune(named, tmp_path / "x.yaml", "--try", "unet_width=8")
    assert result.returncode == 2 and "KEY one of" in result.stderr
    (tmp_path / "y.yaml").write_text("")  # the user's: never replaced
    result = tune(named, tmp_path / "y.yaml", "--overwrite")
    assert result.returncode == 2 and "y.yaml was not written by this project and is never replaced" in result.stderr
    mark(tmp_path, ["y.yaml"], by="bench.tune")  # as an earlier tuning leaves it
    result = tune(named, tmp_path / "y.yaml")
    assert result.returncode == 2 and "y.yaml exists: --overwrite replaces it" in result.stderr
    result = tune(named, tmp_path / "z.yaml", "--config", "nothing")
    assert result.returncode == 2 and "no config named 'nothing'" in result.stderr


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss/train"] for r in records if "loss/train" in r]


@pytest.mark.parametrize("benchmark, limit_tried", [(None, True), (False, False)])
def test_on_a_gpu_each_fast_path_is_tried_against_the_settings_so_far(benchmark, limit_tried):
    """The GPU's candidates, listed without one: each switch turned from what it is now (null: channels_last and
    cudnn_benchmark on), and cuDNN timing every algorithm where it autotunes."""
    raw = {**load_named(DEFAULT_YAML, "debug"), "cudnn_benchmark": benchmark}
    tuner = Tuner(SimpleNamespace(budget_s=1, config="debug", repeats=1, ranks=1), build_config(raw, {}), raw)
    tuner.device_type = "cuda"
    found = {c.label: c.settings for c in tuner.stage_candidates("fast_paths")}
    switched = "cudnn_benchmark True" if benchmark is False else "cudnn_benchmark False"
    expected = {
        "as chosen so far": {},
        "channels_last False": {"channels_last": False},
        "compile True": {"compile": True},
    }
    expected[switched] = {"cudnn_benchmark": benchmark is False}
    if limit_tried:
        expected["cudnn_benchmark_limit 0"] = {"cudnn_benchmark_limit": 0}
    assert found == expected
