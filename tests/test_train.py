"""ds_train.py end to end, as a user runs it: real DeepSpeed engine, real DALI pipeline, real files."""

import json
import re
import shutil

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import run_train, shared_tiny_args


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Three epochs in one go (the reference for the resume test), the storage chosen by what fits."""
    root = tmp_path_factory.mktemp("straight")
    _ok(run_train(shared_tiny_args(root, root / "run", "--num_epochs", "3", "--storage", "auto")))
    return root / "run"


def test_training_learns_and_leaves_a_complete_run_dir(straight):
    summary = json.loads((straight / "summary.json").read_text())
    for key in (
        "initial_val_loss",
        "final_val_loss",
        "epochs",
        "steps",
        "wall_s",
        "samples_per_s",
        "world_size",
        "device",
        "precision",
    ):
        assert key in summary, key
    assert summary["final_val_loss"] < 0.7 * summary["initial_val_loss"]
    assert (summary["epochs"], summary["steps"], summary["world_size"], summary["precision"]) == (3, 48, 1, "fp32")
    assert summary["samples_per_s"] > 0
    assert summary["storage"] == "host"  # auto, on a CPU with room for the boxes
    assert "storage auto: host (one copy per node and the batch buffers (" in (straight / "train.log").read_text()

    resolved = json.loads((straight / "config.json").read_text())
    assert resolved["name"] == "debug" and resolved["config"]["num_epochs"] == 3
    assert resolved["deepspeed"]["train_batch_size"] == 8 and not resolved["deepspeed"].get("fp16", {}).get("enabled")

    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss/train" in r]
    valid = [r for r in records if "loss/valid" in r]
    assert [r["step"] for r in train] == list(range(4, 49, 4))
    assert [r["step"] for r in valid] == [0, 16, 32, 48]
    assert (
        valid[0]["loss/valid"] == summary["initial_val_loss"] and valid[-1]["loss/valid"] == summary["final_val_loss"]
    )
    assert train[-1]["lr"] == 0.0  # the cosine reaches end_lr at the last step
    assert all(0 <= r["data_wait_pct"] <= 100 for r in train) and 0 <= summary["data_wait_pct"] <= 100

    (events,) = (straight / "tensorboard").iterdir()
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "loss/valid", "lr", "throughput/samples_per_s", "data_wait_pct"} <= tags
    assert [e.step for e in acc.Scalars("loss/valid")] == [0, 16, 32, 48]

    checkpoints = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step00000016", "step00000032", "step00000048"]  # one per epoch, by global step
    assert (straight / "checkpoints" / "latest").read_text().strip() == "step00000048"
    assert "validation loss" in (straight / "train.log").read_text()


def test_every_log_point_says_the_critical_batch(straight):
    """One rank without accumulation: each micro-batch is split in two to measure the gradient noise scale, which
    every log point gives (TensorBoard, metrics.jsonl, the console) and the summary keeps."""
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss/train" in r]
    assert all(r["noise/b_simple"] > 0 and r["noise/trace_sigma"] > 0 for r in trained[1:])
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["noise_scale"]["b_simple"] == trained[-1]["noise/b_simple"]
    (events,) = (straight / "tensorboard").iterdir()
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    assert [e.step for e in acc.Scalars("noise/b_simple")] == [r["step"] for r in trained if "noise/b_simple" in r]
    log = (straight / "train.log").read_text()
    assert "noise scale: from the halves of each micro-batch of 8" in log and ", critical batch ~ " in log


def test_resume_continues_exactly(tmp_path, straight):
    run = tmp_path / "run"
    first = json.loads(
        _ok(run_train(shared_tiny_args(tmp_path, run, "--num_epochs", "3", "--stop_after_epoch", "2")))
        and (run / "summary.json").read_text()
    )
    assert (first["epochs"], first["finished"]) == (2, False)
    _ok(run_train(["--run_dir", str(run), "--resume"]))
    resumed = json.loads((run / "summary.json").read_text())
    expected = json.loads((straight / "summary.json").read_text())
    assert (resumed["epochs"], resumed["steps"]) == (3, 48)
    assert resumed["resumed_from"] == {"epoch": 2, "batch_in_epoch": 0}
    assert resumed["initial_val_loss"] == expected["initial_val_loss"]
    assert resumed["final_val_loss"] == expected["final_val_loss"]  # bit for bit: same draws, same state


def test_a_step_cadence_saves_mid_epoch_and_resumes_from_there_exactly(tmp_path, straight):
    """Every 20 optimizer steps and at the end, none at the epochs' ends (16 steps each): a resume from step 20, 4
    batches into the second epoch, ends bit for bit where the uninterrupted run ended."""
    run = tmp_path / "run"
    cadence = ["--checkpoint_every_epochs", "0", "--checkpoint_every_steps", "20", "--checkpoint_keep", "5"]
    _ok(run_train(shared_tiny_args(tmp_path, run, "--num_epochs", "3", *cadence)))
    ckpt = run / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step00000020", "step00000040", "step00000048"]
    for later in ("step00000040", "step00000048"):  # as if the run had been killed after step 20's checkpoint
        shutil.rmtree(ckpt / later)
    (ckpt / "latest").write_text("step00000020")
    _ok(run_train(["--run_dir", str(run), "--resume"]))
    resumed = json.loads((run / "summary.json").read_text())
    expected = json.loads((straight / "summary.json").read_text())
    assert resumed["resumed_from"] == {"epoch": 1, "batch_in_epoch": 4}
    assert resumed["final_val_loss"] == expected["final_val_loss"]
    assert resumed["rank_weight_digests"] == expected["rank_weight_digests"]


def test_a_step_cadence_at_an_epochs_end_saves_once_with_the_epoch_done(tmp_path):
    """Every 16 steps, the length of an epoch: the save due at its last step waits for the epoch's validation, so
    that its checkpoint says the epoch is done (a resume starts the next one) and the step is saved once."""
    run = tmp_path / "run"
    cadence = ["--checkpoint_every_epochs", "0", "--checkpoint_every_steps", "16"]
    _ok(run_train(shared_tiny_args(tmp_path, run, "--num_epochs", "2", *cadence)))
    saved = re.findall(r"checkpoint (step\d+) saved", (run / "train.log").read_text())
    assert saved == ["step00000016", "step00000032"]
    shutil.rmtree(run / "checkpoints" / "step00000032")
    (run / "checkpoints" / "latest").write_text("step00000016")
    _ok(run_train(["--run_dir", str(run), "--resume"]))
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == {"epoch": 1, "batch_in_epoch": 0}


def test_backends_and_storage_modes_train_identically(tmp_path, straight):
    # Same draws, same samples, same model: a run whose DALI graph slices and rotates its crops ends bit for bit where
    # the default on a CPU (the torch backend's batcher) does.
    _ok(run_train(shared_tiny_args(tmp_path, tmp_path / "run", "--num_epochs", "3", "--backend", "dali")))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    expected = json.loads((straight / "summary.json").read_text())
    assert (summary["backend"], summary["storage"], expected["backend"], expected["storage"]) == (
        "dali",
        "host",
        "torch",
        "host",
    )
    assert summary["final_val_loss"] == expected["final_val_loss"]


def test_a_new_run_never_reuses_a_run_dir_with_checkpoints(straight, tmp_path):
    before = sorted(p.stat().st_mtime_ns for p in (straight / "checkpoints").rglob("*"))
    result = run_train(shared_tiny_args(tmp_path, straight, "--num_epochs", "1"))
    assert result.returncode == 2
    assert (
        "holds an earlier run (config.json, metrics.jsonl, summary.json, train.log, tensorboard, checkpoints): --resume"
        in result.stderr
    )
    assert sorted(p.stat().st_mtime_ns for p in (straight / "checkpoints").rglob("*")) == before


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--synthetic", "null", "--train_path", "/nonexistent/train.h5"], "/nonexistent/train.h5: no such data file"),
        (["--num_epochs", "three"], "num_epochs must be int, got 'three'"),
        (["--global_batch_size", "12", "--micro_batch_size", "8"], "not a multiple of micro_batch_size 8"),
        (["--deepspeed_config", "/nonexistent.json"], "cannot read DeepSpeed config /nonexistent.json"),
        (["--science_box_size", "8"], "science_box_size 8 is smaller than data_size 16"),
        (["--science_box_size", "64"], "science_box_size 64 is larger than the validation box (32)"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, extra, message):
    result = run_train(shared_tiny_args(tmp_path, tmp_path / "run", *extra))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


HIDE_DALI = """
import sys


class NoDali:  # this interpreter behaves as if NVIDIA DALI were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[:2] == ["nvidia", "dali"]:
            raise ModuleNotFoundError(f"No module named {name!r}")


sys.meta_path.insert(0, NoDali())
"""


def test_the_dali_backend_without_dali_is_one_clear_line(tmp_path, monkeypatch):
    (tmp_path / "no-dali").mkdir()
    (tmp_path / "no-dali" / "sitecustomize.py").write_text(HIDE_DALI)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "no-dali"))
    result = run_train(shared_tiny_args(tmp_path, tmp_path / "run", "--backend", "dali"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    message = "backend: dali needs NVIDIA DALI, not installed here (requirements.txt); or set backend: torch"
    assert len(errors) == 1 and errors[0].endswith(message)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    result = run_train(["--run_dir", str(tmp_path / "empty"), "--resume"])
    assert result.returncode == 2 and "config.json not found" in result.stderr


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="bf16 on CPU needs oneDNN")
def test_bf16_on_cpu(tmp_path):
    _ok(
        run_train(
            shared_tiny_args(
                tmp_path, tmp_path / "run", "--num_epochs", "1", "--deepspeed_config", "ds_configs/ds_bf16.json"
            )
        )
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == "bf16"
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def test_profile_records_a_trace_of_the_step_phases(tmp_path):
    # one forward a step: no micro-batch split in two for the noise scale
    _ok(
        run_train(
            shared_tiny_args(tmp_path, tmp_path / "run", "--num_epochs", "1", "--profile", "--noise_scale", "false")
        )
    )
    traces = list((tmp_path / "run" / "profile").glob("rank0*.pt.trace.json*"))
    assert len(traces) == 1, sorted(p.name for p in (tmp_path / "run").rglob("*"))
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"data_wait", "forward", "backward", "optimizer_step"} <= names
    assert sum(e.get("name") == "forward" for e in events) == 3  # the three recorded steps
    # Where the time went: the ten most expensive operators, and each U-Net block's share forward and backward.
    table = (tmp_path / "run" / "profile" / "summary_rank0.txt").read_text().splitlines()
    assert table[0].startswith("CPU operators: ") and table[2] == "the 10 most expensive:"
    assert len([line for line in table[3:13] if " ms " in line and "aten::" in line]) == 10
    rows = table[table.index("per block:         forward            backward") + 1 : -1]
    assert table[-1].startswith("outside the blocks (loss, optimizer, data, other): ")
    blocks = {line.split()[0]: line.split() for line in rows}
    assert {"down.0", "down.3", "up.0", "up.2", "last"} <= set(blocks)  # the tiny config's U-Net of depth 4
    forward_ms, backward_ms = ({name: float(row[i]) for name, row in blocks.items()} for i in (1, 4))
    assert all(forward_ms[name] > 0 and backward_ms[name] > 0 for name in ("down.0", "up.2", "last"))
    assert sum(f"forward {name}" in names for name in ("down.0", "up.2", "last")) == 3  # ranges in the trace too


def test_profile_says_when_the_run_is_too_short_for_a_trace(tmp_path):
    result = _ok(
        run_train(shared_tiny_args(tmp_path, tmp_path / "run", "--num_epochs", "1", "--Nsamples", "8", "--profile"))
    )
    assert "--profile: the run ended before the recorded steps began: no trace was written" in result.stderr
    assert not list((tmp_path / "run" / "profile").glob("rank0*"))
