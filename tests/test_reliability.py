"""Faults provoked for real: bad input, kills during a save, stop signals, NaNs in data and losses."""

import json
import os
import shutil
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from model.checkpoints import newest_intact
from tests.conftest import REPO, TINY_ARGS, logged, run_train, single_process_env, start_train, tiny_args, wait_until
from trainer.errors import HostfileError
from trainer.hostfile import parse_hostfile

TRAIN_ENV = single_process_env()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny boxes, written by a first short run."""
    root = tmp_path_factory.mktemp("reliability")
    paths = {"train": root / "train.h5", "val": root / "val.h5"}
    result = run_train(tiny_args(paths["train"], paths["val"], root / "first", "--num_epochs", "1"))
    assert result.returncode == 0, result.stderr[-2000:]
    return paths


def _args(data, run_dir, *extra, train=None):
    return tiny_args(train or data["train"], data["val"], run_dir, *extra)


def _one_error_line(result, code=2):
    assert result.returncode == code, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def _with_nan(data, tmp_path, region=np.s_[0, 5:7, 5:7, 5:7], dataset="Nbody"):
    path = tmp_path / "nan.h5"
    shutil.copy(data["train"], path)
    with h5py.File(path, "a") as f:
        values = f[dataset][...]
        values[region] = np.nan
        f[dataset][...] = values
    return path


# --- bad input: one line, exit 2, before expensive work --------------------------------------------------


def test_nan_in_the_data_is_found_at_start_up(data, tmp_path):
    bad = _with_nan(data, tmp_path, dataset="Hydro")
    line = _one_error_line(run_train(_args(data, tmp_path / "run", "--num_epochs", "1", train=bad)))
    assert f"{bad}: the targets hold NaN or Inf values" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_truncated_hdf5(data, tmp_path):
    bad = tmp_path / "truncated.h5"
    bad.write_bytes(data["train"].read_bytes()[:200_000])
    assert f"{bad}: not a readable HDF5 file" in _one_error_line(run_train(_args(data, tmp_path / "run", train=bad)))


def test_malformed_yaml_and_unknown_keys_in_a_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("mine:\n  num_epochs: [3\n")
    assert "is not valid YAML" in _one_error_line(run_train(["--yaml_config", str(broken), "--config", "mine"]))
    typo = tmp_path / "typo.yaml"
    typo.write_text("mine:\n  num_epoch: 3\n")
    line = _one_error_line(run_train(["--yaml_config", str(typo), "--config", "mine"]))
    assert "unknown key 'num_epoch' (did you mean 'num_epochs'?)" in line


def test_deepspeed_json_inconsistent_with_the_batch(data, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 99}))
    line = _one_error_line(run_train(_args(data, tmp_path / "run", "--deepspeed_config", str(ds))))
    assert "train_batch_size=99, but the experiment's batch settings give 8" in line


def test_malformed_hostfiles(tmp_path):
    cases = {
        "nodeA slots=4\nnodeB slots four\n": "line 2: expected '<hostname> slots=<ranks>', got 'nodeB slots four'",
        "nodeA slots=0\n": "line 1: nodeA has slots=0",
        "nodeA slots=4\n# comment\nnodeA slots=4\n": "line 3: nodeA is listed twice",
        "# nothing\n\n": "no hosts",
    }
    for text, message in cases.items():
        path = tmp_path / "hostfile"
        path.write_text(text)
        with pytest.raises(HostfileError, match=message):
            parse_hostfile(path)
    assert parse_hostfile(REPO / "hostfiles" / "two_nodes_4gpu") == [("nid001001", 4), ("nid001002", 4)]
    cli = subprocess.run(
        [sys.executable, "-m", "trainer.hostfile", str(path)], cwd=REPO, capture_output=True, text=True
    )
    assert cli.returncode == 2 and cli.stderr.strip().endswith("no hosts (every line is blank or a comment)")


# --- resuming: missing, incompatible or changed ------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    assert run_train(_args(data, run, "--num_epochs", "2")).returncode == 0
    return run


def _snapshot(run):
    return {p.relative_to(run): p.stat().st_mtime_ns for p in (run / "checkpoints").rglob("*")}


def test_resume_refuses_an_incompatible_checkpoint_and_keeps_it(finished):
    before = _snapshot(finished)
    result = run_train(["--run_dir", str(finished), "--resume", "--unet_width", "8", "--allow_config_change"])
    assert "does not fit this model" in _one_error_line(result)
    assert _snapshot(finished) == before


def test_resume_refuses_changes_to_the_training_but_reports_harmless_ones(finished, tmp_path):
    line = _one_error_line(
        run_train(["--run_dir", str(finished), "--resume", "--num_epochs", "5", "--lambda_rho", "0.1"])
    )
    assert "settings that change the training: lambda_rho 0.0 -> 0.1, num_epochs 2 -> 5" in line
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    result = run_train(["--run_dir", str(copy), "--resume", "--log_every_steps", "8"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming with changed settings: log_every_steps 4 -> 8" in result.stderr


def _tree(run):
    return {p.relative_to(run): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def test_overwrite_is_explicit_and_deletes_only_once_the_new_run_has_passed_its_checks(finished, data, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    assert "--resume continues a run and --overwrite deletes it" in _one_error_line(
        run_train(["--run_dir", str(copy), "--resume", "--overwrite"])
    )
    before = _tree(copy)
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(data["train"].read_bytes()[:200_000])
    bad = run_train(_args(data, copy, "--num_epochs", "1", "--overwrite", train=truncated))
    assert "truncated.h5: not a readable HDF5 file" in _one_error_line(bad)
    assert "the earlier run in" in bad.stderr and _tree(copy) == before  # put back as it was, its log included
    result = run_train(_args(data, copy, "--num_epochs", "1", "--overwrite"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((copy / "summary.json").read_text())["epochs"] == 1
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["latest", "step00000016"]
    assert not (copy / ".overwritten").exists()
    # An overwrite killed before it settled leaves the earlier run set aside: no start of any kind touches it.
    interrupted = tmp_path / "interrupted"
    shutil.copytree(finished, interrupted / ".overwritten")
    leftover = _tree(interrupted)
    for extra in ([], ["--overwrite"], ["--resume"]):
        line = _one_error_line(run_train(_args(data, interrupted, *extra)))
        assert "holds an earlier run that an interrupted --overwrite set aside: move its files back" in line
    assert _tree(interrupted) == leftover


def test_a_run_directory_has_one_writer(data, tmp_path):
    """A second start in the directory of a run that is training, to continue it or to replace it, is refused in one
    line naming the holder and touches nothing; the first run goes on, stops on request and leaves no hold."""
    run = tmp_path / "run"
    proc = start_train(_args(data, run, "--num_epochs", "200"))
    try:
        wait_until(proc, lambda: logged(run, '"loss/train"'), 240, "the first run never trained")
        for second in (["--run_dir", str(run), "--resume"], _args(data, run, "--overwrite")):
            line = _one_error_line(run_train(second))
            assert f"{run} is held by process {proc.pid} (ds_train.py) on " in line
            assert line.endswith("wait for it to end, or choose another --run_dir")
            assert proc.poll() is None and not (run / ".overwritten").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75
    finally:
        proc.kill()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preempted"] and summary["steps"] > 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and not (run / "metrics.abandoned.jsonl").exists()  # one writer's history
    tag, damaged = newest_intact(run)
    assert tag == (run / "checkpoints" / "latest").read_text() and not damaged
    assert not (run / ".hold").exists() and not (run / ".hold.json").exists()


# --- checkpoints are never lost --------------------------------------------------------------------------


def test_a_kill_during_a_save_leaves_the_previous_checkpoint(data, tmp_path):
    # A model big enough (25 M parameters, about 300 MB of checkpoint) that a save takes a while.
    run = tmp_path / "run"
    args = _args(data, run, "--unet_width", "64", "--Nsamples", "16", "--Nsamples_val", "8", "--num_epochs", "3")
    proc = start_train(args)
    ckpt = run / "checkpoints"
    try:
        wait_until(proc, (ckpt / "step00000002").is_dir, 240, "the first checkpoint never appeared")
        saving = lambda: any(ckpt.glob(".step00000004.partial"))  # noqa: E731
        wait_until(proc, saving, 240, "the second save never started", poll=0.002)
        proc.send_signal(signal.SIGKILL)  # in the middle of writing the second checkpoint
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert (ckpt / "latest").read_text() == "step00000002"
    assert not (ckpt / "step00000004").exists()
    result = run_train(["--run_dir", str(run), "--resume"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"took over the hold of process {proc.pid} (ds_train.py)" in result.stderr  # the killed run's, at once
    reclaimed = f"reclaimed what killed saves left in {ckpt}: .step00000004.partial ("
    assert len([line for line in result.stderr.splitlines() if reclaimed in line]) == 1  # at the start, said once
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == {"epoch": 1, "batch_in_epoch": 0} and summary["finished"]
    assert not list(ckpt.glob(".*.partial"))


def _digest(run):
    return json.loads((run / "summary.json").read_text())["rank_weight_digests"]


def test_a_damaged_newest_checkpoint_is_named_set_aside_and_resume_takes_the_one_before(finished, tmp_path):
    """The newest checkpoint's model file cut to 1,000 bytes, as a crash or a full disk leaves it: one warning names
    the file and what is wrong, the run resumes from the intact checkpoint before it and ends bit for bit where the
    undamaged run ended; nothing is deleted, and the steps done again are logged once."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ckpt = run / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step00000016", "step00000032"]
    manifest = json.loads((ckpt / "step00000032" / "manifest.json").read_text())["files"]
    assert "mp_rank_00_model_states.pt" in manifest and all(len(f["sha256"]) == 64 for f in manifest.values())
    model = ckpt / "step00000032" / "mp_rank_00_model_states.pt"
    size = model.stat().st_size
    model.write_bytes(model.read_bytes()[:1000])
    result = run_train(["--run_dir", str(run), "--resume"])
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if " WARNING " in line]
    assert (
        f"checkpoint {ckpt / 'step00000032'} is damaged (mp_rank_00_model_states.pt truncated: 1,000 of {size:,} "
        in warnings[0]
    )
    assert "set aside as step00000032.damaged" in warnings[0] and all(len(w) < 300 for w in warnings)
    assert "resuming from step00000016, the newest intact checkpoint" in result.stderr
    assert (ckpt / "step00000032.damaged" / "mp_rank_00_model_states.pt").stat().st_size == 1000  # kept as found
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step00000016", "step00000032", "step00000032.damaged"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == {"epoch": 1, "batch_in_epoch": 0} and summary["finished"]
    assert _digest(run) == _digest(finished)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [
        json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if "loss/train" in line
    ]
    assert train_steps == sorted(set(train_steps)) and max(steps) == 32
    abandoned = [json.loads(line) for line in (run / "metrics.abandoned.jsonl").read_text().splitlines()]
    assert abandoned and all(r["step"] > 16 for r in abandoned)


def test_resume_with_no_intact_checkpoint_names_each_one_and_changes_nothing(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ckpt = run / "checkpoints"
    (ckpt / "step00000032" / "mp_rank_00_model_states.pt").unlink()
    model = ckpt / "step00000016" / "mp_rank_00_model_states.pt"
    damaged = bytearray(model.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01  # one bit flipped: same size, another checksum
    model.write_bytes(bytes(damaged))
    before = _snapshot(run)
    line = _one_error_line(run_train(["--run_dir", str(run), "--resume"]))
    assert line.endswith(
        f"--resume: no intact checkpoint in {ckpt} (step00000032: mp_rank_00_model_states.pt missing; "
        "step00000016: mp_rank_00_model_states.pt checksum mismatch)"
    )
    assert _snapshot(run) == before


def test_a_checkpoint_from_before_manifests_resumes_unverified(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for manifest in (run / "checkpoints").glob("*/manifest.json"):
        manifest.unlink()
    result = run_train(["--run_dir", str(run), "--resume", "--num_epochs", "2"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "checkpoint step00000032 has no manifest (written before checkpoints were verified): resumed unverified" in (
        result.stderr
    )
    # Beside a checkpoint that has one, a missing manifest is damage: the run goes back to the one that has it.
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    (copy / "checkpoints" / "step00000032" / "manifest.json").unlink()
    result = run_train(["--run_dir", str(copy), "--resume"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step00000032 is damaged (manifest.json missing): set aside" in result.stderr


def test_a_save_that_fails_part_way_loses_nothing_and_resume_continues_exactly(data, finished, tmp_path):
    """A file size limit (ulimit -f, SIGXFSZ ignored: writes fail with EFBIG) that the first checkpoint fits and the
    second does not: one line naming the directory and the error, the first checkpoint and latest untouched, no
    partial directory left; --resume without the limit ends bit for bit where the uninterrupted run ended."""
    run = tmp_path / "run"
    first = run_train(_args(data, run, "--num_epochs", "2", "--stop_after_epoch", "1"))
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = run / "checkpoints"
    before = _snapshot(run)
    largest = max(p.stat().st_size for p in (ckpt / "step00000016").iterdir())
    limit_blocks = largest // 1024 // 2  # KiB (bash): half the largest checkpoint file; the log and metrics stay below
    # storage lazy: the limit would also refuse host storage's shared copy, a file in /dev/shm
    resume = f"ds_train.py --run_dir {run} --resume --storage lazy"
    script = f"trap '' XFSZ; ulimit -f {limit_blocks}; exec {sys.executable} {resume}"
    limited = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=TRAIN_ENV, capture_output=True, text=True, timeout=300
    )
    line = _one_error_line(limited)
    limit = limit_blocks * 1024
    assert line.endswith(
        f"saving checkpoint step00000032 into {ckpt} failed (a file reached this process's file size limit of "
        f"{limit:,} bytes, ulimit -f): the previous checkpoint and latest are as they were"
    )
    assert _snapshot(run) == before and (ckpt / "latest").read_text() == "step00000016"
    assert not list(ckpt.glob(".*.partial"))
    result = run_train(["--run_dir", str(run), "--resume"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert _digest(run) == _digest(finished)


# --- stopping on request -----------------------------------------------------------------------------------


def test_both_stop_signals_ask_for_a_stop():
    """SIGTERM (a preemption, a cancel) and SIGUSR1 (sbatch --signal before the time limit) are the same request;
    the run below stops on one of them, end to end."""
    from trainer.preemption import StopRequest

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        for sig in previous:
            stop = StopRequest()
            assert not stop.requested
            os.kill(os.getpid(), sig)
            assert stop.requested and stop.signal_name == sig.name
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_stop_signal_checkpoints_exits_75_and_resume_continues_exactly(data, finished, tmp_path):
    sig = signal.SIGUSR1
    run = tmp_path / "run"
    proc = start_train(_args(data, run, "--num_epochs", "2"), stderr=subprocess.PIPE)
    wait_until(proc, lambda: logged(run, '"step": 20,'), 120, "step 20 was never logged")
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr[-2000:]
    assert f"stopped on request ({sig.name})" in stderr
    stopped = json.loads((run / "summary.json").read_text())
    step = int((run / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert stopped["preempted"] and not stopped["finished"] and stopped["steps"] == step and 20 <= step < 32
    result = run_train(["--run_dir", str(run), "--resume"])
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["resumed_from"] == {"epoch": 1, "batch_in_epoch": step - 16} and resumed["steps"] == 32
    # Bit for bit where the uninterrupted two-epoch run ended.
    assert resumed["final_val_loss"] == json.loads((finished / "summary.json").read_text())["final_val_loss"]


# --- numerical faults --------------------------------------------------------------------------------------


def test_nonfinite_losses_are_skipped_and_counted(data, tmp_path):
    bad = _with_nan(data, tmp_path)  # a few NaN voxels: the batches whose crops cover them give a NaN loss
    whole = ["--noise_scale", "false"]  # each step one micro-batch, not split in two for the noise scale
    result = run_train(_args(data, tmp_path / "run", "--num_epochs", "2", "--data_checks", "none", *whole, train=bad))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["nonfinite_losses"] > 0 and summary["steps"] == 32 - summary["nonfinite_losses"]
    assert np.isfinite(summary["final_val_loss"]) and summary["final_val_loss"] < summary["initial_val_loss"]
    assert "non-finite loss at epoch" in result.stderr


def test_a_skipped_micro_batch_adds_nothing_and_each_epoch_ends_on_its_own_steps(data, tmp_path):
    """With accumulation, a micro-batch skipped for a non-finite loss adds no gradient to its step, which still ends
    with the step's own micro-batches (a step skipped whole is not taken): no gradient is carried into the next epoch,
    so a run stopped after its first epoch and resumed ends bit for bit where the uninterrupted run ends."""
    bad = _with_nan(data, tmp_path)
    accumulated = ["--micro_batch_size", "4", "--num_epochs", "2", "--data_checks", "none"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    for run_dir, extra in ((straight, []), (split, ["--stop_after_epoch", "1"])):
        result = run_train(_args(data, run_dir, *accumulated, *extra, train=bad))
        assert result.returncode == 0, result.stderr[-2000:]
    result = run_train(["--run_dir", str(split), "--resume"])
    assert result.returncode == 0, result.stderr[-2000:]
    whole, resumed = (json.loads((d / "summary.json").read_text()) for d in (straight, split))
    assert whole["accumulation"] == 2 and whole["nonfinite_losses"] > 0
    assert resumed["resumed_from"] == {"epoch": 1, "batch_in_epoch": 0}
    assert whole["steps"] == resumed["steps"] <= 32 and whole["nonfinite_losses"] == resumed["nonfinite_losses"]
    assert whole["final_val_loss"] == resumed["final_val_loss"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--nonfinite_loss", "stop"], "non-finite loss at epoch 1"),
        (
            ["--nonfinite_loss", "skip", "--max_nonfinite_in_a_row", "3", "--region", "all"],
            "3 non-finite losses in a row",
        ),
        (["--nonfinite_loss", "ignore"], "weights at step 16 are not finite: not saving them"),
    ],
)
def test_nonfinite_losses_stop_the_run_as_configured(data, tmp_path, extra, message):
    region = np.s_[...] if "all" in extra else np.s_[0, 5:7, 5:7, 5:7]
    extra = [e for e in extra if e not in ("--region", "all")]
    bad = _with_nan(data, tmp_path, region=region)
    run = tmp_path / "run"
    line = _one_error_line(
        run_train(_args(data, run, *extra, "--num_epochs", "1", "--data_checks", "none", train=bad)), code=3
    )
    assert message in line
    assert (
        not list((run / "checkpoints").glob("step*")) if (run / "checkpoints").exists() else True
    )  # nothing NaN saved


def test_every_batch_data_check_catches_data_that_changes_under_a_run(data, tmp_path):
    # The start-up check passes; then another job overwrites the (memory-mapped, lazily read) inputs with NaNs.
    from pipeline.convert import convert

    inputs, targets = convert(data["train"], tmp_path / "train", "CDHW")
    val_in, val_tar = convert(data["val"], tmp_path / "val", "CDHW")
    run = tmp_path / "run"
    args = [
        *TINY_ARGS,
        "--synthetic",
        "null",
        "--data_format",
        "npy",
        "--storage",
        "lazy",
        "--data_checks",
        "every_batch",
        "--train_path_npy_data",
        str(inputs),
        "--train_path_npy_label",
        str(targets),
        "--val_path_npy_data",
        str(val_in),
        "--val_path_npy_label",
        str(val_tar),
        "--run_dir",
        str(run),
        "--num_epochs",
        "50",
    ]
    proc = start_train(args, stderr=subprocess.PIPE)
    wait_until(proc, lambda: logged(run, "loss/train"), 120, "training did not start", poll=0.05)
    volume = np.load(inputs, mmap_mode="r+")
    volume[...] = np.nan
    volume.flush()
    _, stderr = proc.communicate(timeout=120)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
    assert "a training batch holds NaN or Inf values" in _one_error_line(result)


def test_yaml_booleans_get_a_hint():
    from trainer.config import build_config
    from trainer.errors import ConfigError

    with pytest.raises(
        ConfigError, match="data_checks must be one of .* got False \\(YAML reads yes/no/on/off as booleans"
    ):
        build_config({"data_checks": False}, {})


def test_a_run_record_that_cannot_be_written_is_one_line(finished, tmp_path):
    """summary.json cannot replace what stands at its place (a directory here; a full disk says so the same way):
    one line naming the file and the reason, status 2, the checkpoints as they were."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "summary.json").unlink()
    (run / "summary.json").mkdir()
    before = _snapshot(run)
    line = _one_error_line(run_train(["--run_dir", str(run), "--resume"]))
    assert line.endswith(f"{run / 'summary.json'}: Is a directory")
    assert _snapshot(run) == before
