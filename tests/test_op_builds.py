"""The lock of a DeepSpeed op's build: a build stopped part way must not leave every later start waiting for ever."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

from tests.conftest import run_train, tiny_args
from trainer.op_builds import build_dir, settle_build_lock, use_environment_ninja

OP = "some_op"


def _lock(monkeypatch, tmp_path, age_s: float):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = build_dir(OP) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_left_by_a_stopped_build_is_removed_with_a_warning(monkeypatch, tmp_path, caplog):
    lock = _lock(monkeypatch, tmp_path, age_s=3600)
    with caplog.at_level("WARNING", logger="trainer.op_builds"):
        settle_build_lock(OP, clears=True)
    assert not lock.exists()
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith(f"removed {lock}, left 3600 s ago by a build")


def test_a_young_lock_is_waited_for_until_it_is_old_enough(monkeypatch, tmp_path, caplog):
    lock = _lock(monkeypatch, tmp_path, age_s=0)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="trainer.op_builds"):
        settle_build_lock(OP, clears=True, stale_s=2)
    assert time.monotonic() - start >= 1.5 and not lock.exists()
    assert [m.split(" (")[0].split(",")[0] for m in caplog.messages] == [
        f"waiting for the build of DeepSpeed's {OP} to finish",
        f"removed {lock}",
    ]
    assert (
        "held by no process here); a lock no process here holds is taken as left behind once 2 s old, and removed"
        in caplog.text
    )


def test_a_lock_a_build_holds_is_never_removed(monkeypatch, tmp_path, caplog):
    """torch's builder keeps its lock open while it builds, then removes it: however old, it is waited for."""
    lock = _lock(monkeypatch, tmp_path, age_s=3600)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, sys, time; fd = os.open({str(lock)!r}, os.O_RDONLY); print(flush=True); "
            "time.sleep(2); os.remove(sys.argv[1])",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        holder.stdout.readline()  # the lock is held
        with caplog.at_level("WARNING", logger="trainer.op_builds"):
            settle_build_lock(OP, clears=True, stale_s=0)
        assert holder.wait(timeout=30) == 0  # the holder removed it: settle_build_lock waited for that
    finally:
        holder.kill()
    assert caplog.messages == [
        f"waiting for the build of DeepSpeed's {OP} to finish (lock {lock}, 3600 s old, held by process {holder.pid})"
    ]


def test_only_the_clearing_process_removes_a_lock(monkeypatch, tmp_path, caplog):
    """Every other rank of a machine waits for local rank 0 to remove it."""
    lock = _lock(monkeypatch, tmp_path, age_s=3600)
    clearer = threading.Timer(1.0, lambda: settle_build_lock(OP, clears=True))
    clearer.start()
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="trainer.op_builds"):
        settle_build_lock(OP, clears=False)
    clearer.join()
    assert time.monotonic() - start >= 0.9 and not lock.exists()
    assert caplog.messages[0].startswith("waiting for the build") and caplog.messages[1].startswith("removed")


def test_a_training_run_gets_past_a_lock_left_on_deepspeeds_cpu_op(tmp_path):
    """The case seen: a start killed while DeepSpeed built its CPU communication op left the lock in the shared
    cache, and every later run waited in torch's build for ever, saying nothing."""
    lock = build_dir("deepspeed_shm_comm") / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    data = tmp_path / "data"
    try:
        result = run_train(tiny_args(data / "train.h5", data / "val.h5", tmp_path / "run", "--num_epochs", "1"))
    finally:
        lock.unlink(missing_ok=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(
        rf"removed {re.escape(str(lock))}, left 36\d\d s ago by a build of DeepSpeed's deepspeed_shm_comm",
        result.stderr,
    )


def test_the_environments_ninja_goes_before_the_systems(monkeypatch, tmp_path):
    """A system ninja first on PATH (a venv not activated): the builds use the venv's all the same, so that starts
    with and without the venv active do not rebuild each other's ops; once on PATH, it is not added again."""
    for where in ("usr/bin", "venv/bin"):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
        (tmp_path / where / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "usr" / "bin"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    assert use_environment_ninja() and use_environment_ninja()
    assert shutil.which("ninja") == str(tmp_path / "venv" / "bin" / "ninja")
    assert os.environ["PATH"].split(os.pathsep).count(str(tmp_path / "venv" / "bin")) == 1


def test_a_system_interpreters_directory_is_not_put_first(monkeypatch, tmp_path):
    """Outside a virtual environment the interpreter's directory is /usr/bin: putting it first would hide the
    compilers a user's modules put on PATH, so only a ninja package's own bin directory may go first."""
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (tmp_path / "usr" / "bin" / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'modules'}{os.pathsep}{tmp_path / 'usr' / 'bin'}")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "usr" / "bin" / "python3"))
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)
    monkeypatch.setitem(sys.modules, "ninja", None)  # no ninja package
    assert use_environment_ninja()  # the system's, where it was
    assert os.environ["PATH"].split(os.pathsep)[0] == str(tmp_path / "modules")
