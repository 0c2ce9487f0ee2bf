"""No command changes a file the project did not write: a user's files in each writer's output place are refused
(naming them) or left as they were; no output is an input; what killed runs left is reclaimed at the next start."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from bench.env import append_records
from common.files import size_text
from common.outputs import MARK, marked
from model.checkpoints import reclaim_temporaries
from model.emulator import Emulator, EmulatorSpec, export
from model.emulator import main as export_main
from model.predict import main as predict_main
from pipeline.convert import main as convert_main
from pipeline.synthetic import write_box
from tests.conftest import REPO, TINY_SPEC, run_train, tiny_args, wait_until

USERS = b"the user's own, from elsewhere"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """A tiny emulator as initialized (what it predicts does not matter here), a 16^3 box (one tile) and a 32^3 one
    (three rows of tiles), without a truth (no metrics: the prediction alone)."""
    root = tmp_path_factory.mktemp("emulator")
    spec = EmulatorSpec(
        in_channels=4,
        out_channels=5,
        width=4,
        depth=3,
        crop_size=16,
        input_vectors=[[1, 2, 3]],
        target_vectors=[[1, 2, 3]],
    )
    torch.manual_seed(0)
    export(Emulator(spec, spec.unet.build(), "initialized"), root / "emulator.pt")
    for name, size in (("box", 16), ("rows", 32)):
        write_box(root / f"{name}.h5", TINY_SPEC, size, seed=1)
        with h5py.File(root / f"{name}.h5", "a") as f:
            del f["Hydro"]
    return {"weights": root / "emulator.pt", "box": root / "box.h5", "rows": root / "rows.h5"}


def _users(directory, *names):
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(USERS)
    return {name: (directory / name).stat().st_mtime_ns for name in names}


def _untouched(directory, stamps):
    return all(
        (directory / n).read_bytes() == USERS and (directory / n).stat().st_mtime_ns == t for n, t in stamps.items()
    )


def _errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def _predict(emulator, out, *extra, box="box"):
    return predict_main(
        ["--weights", str(emulator["weights"]), "--input", str(emulator[box]), "--out", str(out), *extra]
    )


def test_predict_refuses_a_directory_of_the_users_files_and_never_replaces_one(emulator, tmp_path, caplog):
    out = tmp_path / "out"
    stamps = _users(out, "metrics.json", "slices.png")  # as users' own files, from elsewhere
    for extra in ([], ["--beside"]):  # names it would write: never, even beside them
        caplog.clear()
        assert _predict(emulator, out, *extra) == 2
        errors = _errors(caplog)
        assert len(errors) == 1 and "holds metrics.json, slices.png, which this project did not write" in errors[0]
    assert _untouched(out, stamps) and not (out / "prediction.h5").exists()
    other = tmp_path / "other"
    stamps = _users(other, "notes.txt")
    caplog.clear()
    assert _predict(emulator, other) == 2
    assert "holds files this project did not write (notes.txt): --beside writes beside them" in _errors(caplog)[0]
    assert _predict(emulator, other, "--beside") == 0
    assert _untouched(other, stamps) and (other / "prediction.h5").is_file()
    assert set(marked(other)) >= {"prediction.h5", "prediction.slabs", "metrics.json"} and "notes.txt" not in marked(
        other
    )
    assert _predict(emulator, other) == 2  # marked or not, the user's file is the user's
    assert _predict(emulator, other, "--beside") == 0 and _untouched(other, stamps)


def test_a_prediction_from_before_marks_is_taken_as_the_projects(emulator, tmp_path):
    """An output directory written before marks existed (here: the mark removed) is recognized by its prediction
    file and its slabs, and predicted into again; a user's file there is not taken for the project's."""
    out = tmp_path / "out"
    assert _predict(emulator, out) == 0
    (out / MARK).unlink()
    stamps = _users(out, "notes.txt")
    assert _predict(emulator, out) == 2 and _predict(emulator, out, "--beside") == 0
    assert {"prediction.h5", "prediction.slabs"} <= set(marked(out)) and "notes.txt" not in marked(out)
    assert _untouched(out, stamps)


def test_no_output_is_an_input(emulator, tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    (out / "prediction.h5").symlink_to(emulator["box"])
    assert _predict(emulator, out) == 2
    assert (
        f"{out / 'prediction.h5'} is the input {emulator['box']}: an output never replaces an input"
        in _errors(caplog)[0]
    )
    with h5py.File(emulator["box"], "r") as f:
        assert "Nbody" in f  # the input as it was


def test_another_predictions_slabs_are_reclaimed_never_assembled(emulator, tmp_path, caplog):
    """Slabs of a prediction with other settings (here: three slab files of one block, then two of two) and a partial
    slab a killed run left: gone before the prediction starts, in one line each; only this one's are assembled."""
    out = tmp_path / "out"
    assert _predict(emulator, out, "--slab_blocks", "1", box="rows") == 0
    slabs = out / "prediction.slabs"
    assert len(list(slabs.glob("slab-*.h5"))) == 3
    (slabs / ".slab-0001.h5.partial").write_bytes(b"\0" * 5000)
    caplog.clear()
    assert _predict(emulator, out, "--slab_blocks", "2", box="rows") == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"reclaimed what killed runs left in {slabs}: .slab-0001.h5.partial (4.9 KiB)" in warnings
    other = "prediction.slabs/slab-0000.h5, prediction.slabs/slab-0001.h5, prediction.slabs/slab-0002.h5, prediction.h5"
    assert any(w.startswith(f"reclaimed another prediction's files in {out}: {other} (") for w in warnings)
    assert sorted(p.name for p in slabs.iterdir()) == ["slab-0000.h5", "slab-0001.h5"]
    with h5py.File(out / "prediction.h5", "r") as f:
        assert len(f["Hydro"].virtual_sources()) == 2 and np.isfinite(f["Hydro"][...]).all()


def _random_box(path, box):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["Nbody"] = rng.standard_normal((4, box, box, box), dtype=np.float32)
        f["Hydro"] = rng.standard_normal((5, box, box, box), dtype=np.float32)
    return path


def test_convert_never_replaces_the_users_files_nor_its_input(tiny_data, tmp_path, capsys):
    stamps = _users(tmp_path, "box_label.npy")
    for extra in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as exit_:
            convert_main([str(tiny_data["val"]), "--out_prefix", str(tmp_path / "box"), *extra])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"{tmp_path / 'box_label.npy'} was not written by this project and is never replaced" in err
    assert _untouched(tmp_path, stamps) and not (tmp_path / "box_data.npy").exists()
    # An HDF5 file named like an output: never its own output, --overwrite or not.
    named = tmp_path / "named"
    named.mkdir()
    source = named / "box_data.npy"
    source.write_bytes(tiny_data["val"].read_bytes())
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "box_label.npy").symlink_to(tiny_data["val"])
    for h5, prefix in ((source, named / "box"), (tiny_data["val"], linked / "box")):
        with pytest.raises(SystemExit) as exit_:
            convert_main([str(h5), "--out_prefix", str(prefix), "--overwrite"])
        assert exit_.value.code == 2 and "an output never replaces an input" in capsys.readouterr().err
    assert source.read_bytes() == tiny_data["val"].read_bytes() and (linked / "box_label.npy").is_symlink()


def test_a_killed_conversions_partial_files_are_reclaimed_by_the_next(tmp_path):
    box = _random_box(tmp_path / "box.h5", 128)
    out = tmp_path / "npy"
    command = [sys.executable, "-m", "pipeline.convert", str(box), "--out_prefix", str(out / "box")]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(proc, lambda: any(out.glob(".box_label.npy.*.partial")), 120, "no partial written", poll=0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    left = sorted(out.glob(".*.partial"))
    assert len(left) == 2  # the pair, made before either is written
    size = size_text(sum(p.stat().st_size for p in left))
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    said = [line for line in again.stdout.splitlines() if line.startswith("reclaimed")]
    assert len(said) == 1 and said[0].startswith(
        f"reclaimed what killed conversions left in {out}: {', '.join(p.name for p in left)} ({size})"
    )
    assert not list(out.glob(".*.partial")) and (out / "box_label.npy").is_file()


def test_export_never_replaces_the_users_file_nor_a_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    model = run / "checkpoints" / "step00000001" / "mp_rank_00_model_states.pt"
    model.parent.mkdir(parents=True)
    model.write_bytes(USERS)
    (run / "config.json").write_text("{}")
    stamps = _users(tmp_path, "mine.pt")
    for extra in ([], ["--overwrite"]):
        assert export_main(["--run_dir", str(run), "--out", str(tmp_path / "mine.pt"), *extra]) == 2
        assert "mine.pt was not written by this project and is never replaced" in capsys.readouterr().err
        assert export_main(["--run_dir", str(run), "--out", str(model), *extra]) == 2
        assert f"{model} is the input {model}" in capsys.readouterr().err
    assert _untouched(tmp_path, stamps) and model.read_bytes() == USERS


def test_records_are_appended_only_to_a_results_file(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    append_records(results, [{"bench": "x", "value": 1}])
    append_records(results, [{"bench": "x", "value": 2}])
    assert [json.loads(line)["value"] for line in results.read_text().splitlines()] == [1, 2]
    stamps = _users(tmp_path, "notes.jsonl")
    with pytest.raises(SystemExit):
        append_records(tmp_path / "notes.jsonl", [{"bench": "x", "value": 3}])
    captured = capsys.readouterr()
    assert "notes.jsonl is not a results file of this project" in captured.err and '"value": 3' in captured.out
    assert _untouched(tmp_path, stamps)


def test_a_killed_saves_leftovers_are_reclaimed_and_a_set_aside_checkpoint_put_back(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for name in ("step00000002", "step00000004", ".step00000004.replaced", ".step00000006.replaced"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 100)
    (ckpt / ".step00000008.partial").mkdir()
    (ckpt / ".latest.x1y2.partial").write_text("step00000008")
    lines = reclaim_temporaries(tmp_path)
    assert (
        lines[0] == "checkpoint step00000006 put back from .step00000006.replaced, where a killed save had set it aside"
    )
    left = ".latest.x1y2.partial, .step00000004.replaced, .step00000008.partial"
    assert lines[1] == f"reclaimed what killed saves left in {ckpt}: {left} (112 bytes)"  # 12 + 100 bytes of files
    assert sorted(p.name for p in ckpt.iterdir()) == ["step00000002", "step00000004", "step00000006"]
    assert reclaim_temporaries(tmp_path) == []


def test_a_run_directory_of_the_users_files_is_refused_and_never_replaced(tiny_data, tmp_path):
    """ds_train.py into a directory holding the user's files: refused in one line naming them; where one has the
    name of a run's file, even with --beside and --overwrite; a data file among the run's outputs is refused. (A run
    beside the user's files: tests/test_prediction.py's trained run.)"""
    run = tmp_path / "run"
    stamps = _users(run, "notes.txt", "config.json")
    result = run_train(tiny_args(tiny_data["train"], tiny_data["val"], run, "--beside", "--overwrite"))
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "holds config.json, which this project did not write and never replaces" in errors[0]
    (run / "config.json").unlink()
    del stamps["config.json"]
    result = run_train(tiny_args(tiny_data["train"], tiny_data["val"], run))
    assert result.returncode == 2 and "holds files this project did not write (notes.txt): --beside" in result.stderr
    assert _untouched(run, stamps) and sorted(p.name for p in run.iterdir() if p.name != MARK) == ["notes.txt"]
    other = tmp_path / "other"
    result = run_train(tiny_args(other / "metrics.jsonl", tiny_data["val"], other))
    assert result.returncode == 2 and "metrics.jsonl is the input" in result.stderr, result.stderr[-2000:]
    assert not (other / "metrics.jsonl").exists()
