"""One writer at a time (common/hold.py): holders are real processes, on one machine or on two (two UTS namespaces,
each with a host name of its own, as the two-node Slurm test cluster makes them), killed for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import trainer.rundir
from common.hold import FLOCK_ENV, LEASE_ENV, hold_file
from tests.conftest import REPO, single_process_env
from trainer.rundir import new_run_path

# Takes the hold and says so, keeps it for argv[2] seconds, then gives it up; refused: one line and status 2.
HOLDER = """
import logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from common.hold import HeldError, hold_directory
try:
    hold = hold_directory(Path(sys.argv[1]), "choose another")
except HeldError as err:
    print(f"refused: {err}", flush=True)
    sys.exit(2)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
hold.release()
"""


def _can_name_hosts() -> bool:
    result = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname node9"], capture_output=True)
    return result.returncode == 0


two_machines = pytest.mark.skipif(not _can_name_hosts(), reason="needs unshare --uts (root) for a second host name")


def _holder(target: Path, hold_s: float, host: str | None = None, **env: str) -> subprocess.Popen:
    command = [sys.executable, "-c", HOLDER, str(target), str(hold_s)]
    if host is not None:  # exec keeps the pid: the one the record names is the one the test kills
        command = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *command]
    return subprocess.Popen(
        command,
        cwd=REPO,
        env={**single_process_env(), "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _held(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line == "held\n", line + proc.stderr.read()


def _refused(proc: subprocess.Popen, timeout: float = 30) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 2, out + err
    (line,) = out.splitlines()
    return line


def _record(target: Path) -> dict:
    return json.loads((target / ".hold.json").read_text())


def test_a_second_holder_is_refused_naming_the_first_which_keeps_its_hold(tmp_path):
    first = _holder(tmp_path, 2)
    try:
        _held(first)
        before = _record(tmp_path)
        line = _refused(_holder(tmp_path, 0))
        assert line.startswith(f"refused: {tmp_path} is held by process {first.pid} (-c) on ")
        assert " since " in line and line.endswith(": choose another")
        assert _record(tmp_path)["token"] == before["token"]
    finally:
        first.communicate(timeout=30)
    assert first.returncode == 0
    assert not list(tmp_path.iterdir())  # given up: the record and the lock file gone
    _held(_holder(tmp_path, 0))


def test_a_killed_holder_is_taken_over_at_once_on_its_machine(tmp_path):
    first = _holder(tmp_path, 60)
    _held(first)
    first.kill()
    first.wait()
    assert _record(tmp_path)["pid"] == first.pid  # what SIGKILL leaves
    second = _holder(tmp_path, 0)
    _held(second)
    second.wait(timeout=30)
    warning = second.stderr.read()
    assert f"took over the hold of process {first.pid}" in warning
    assert "its process ended without releasing it" in warning


@pytest.mark.parametrize("flock", ["on", "off"])
def test_starts_at_the_same_moment_get_one_hold(tmp_path, flock):
    procs = [_holder(tmp_path, 3, **{FLOCK_ENV: flock}) for _ in range(5)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 2, 2, 2, 2], outs
    assert sum(out.startswith("held") for out in outs) == 1


@two_machines
def test_a_live_holder_on_another_machine_is_refused_at_once_where_flock_works(tmp_path):
    first = _holder(tmp_path, 30, host="node1")
    try:
        _held(first)
        start = time.monotonic()
        line = _refused(_holder(tmp_path, 0, host="node2"))
        assert f"held by process {first.pid} (-c) on node1" in line
        assert time.monotonic() - start < 20  # not a lease's wait (60 s)
    finally:
        first.kill()


@two_machines
def test_without_flock_the_lease_decides_across_machines(tmp_path):
    """A file system whose flock does not reach other nodes: a live holder elsewhere is seen renewing its record and
    refuses the start; once killed, its record is taken over after one lease without renewal."""
    lease = {FLOCK_ENV: "off", LEASE_ENV: "1.5"}
    first = _holder(tmp_path, 60, host="node1", **lease)
    try:
        _held(first)
        start = time.monotonic()
        line = _refused(_holder(tmp_path, 0, host="node2", **lease))
        assert f"held by process {first.pid} (-c) on node1" in line
        assert time.monotonic() - start < 1.5 + 10
    finally:
        first.kill()
        first.wait()
    start = time.monotonic()
    second = _holder(tmp_path, 0, host="node2", **lease)
    _held(second)
    assert time.monotonic() - start >= 1.5  # one lease watched without a renewal
    second.wait(timeout=30)
    warnings = second.stderr.read()
    assert "on another machine: waiting up to 1.5 s (its lease)" in warnings
    assert f"took over the hold of process {first.pid}" in warnings and "not renewed for 1.5 s" in warnings


@two_machines
def test_a_requeued_slurm_job_takes_its_own_hold_over_at_once(tmp_path):
    first = _holder(tmp_path, 60, host="node1", SLURM_JOB_ID="77", SLURM_RESTART_COUNT="0")
    _held(first)
    first.kill()
    first.wait()
    start = time.monotonic()
    second = _holder(tmp_path, 0, host="node2", SLURM_JOB_ID="77", SLURM_RESTART_COUNT="1")
    _held(second)
    assert time.monotonic() - start < 30  # not a lease's 60 s
    second.wait(timeout=30)
    assert "Slurm restarted job 77" in second.stderr.read()


def test_a_waiting_hold_takes_its_turn(tmp_path):
    target = tmp_path / "results.jsonl"
    first = hold_file(target, "")
    released = []

    def let_go() -> None:
        time.sleep(0.5)
        released.append(time.monotonic())
        first.release()

    threading.Thread(target=let_go).start()
    with hold_file(target, "", wait_s=30):
        assert released and time.monotonic() >= released[0]


def test_records_are_not_appended_into_a_file_another_benchmark_holds(tmp_path, monkeypatch, capsys):
    import bench.env

    path = tmp_path / "train.jsonl"
    path.write_text('{"bench": "a"}\n')
    monkeypatch.setattr(bench.env, "APPEND_WAIT_S", 0.3)
    with hold_file(path, ""), pytest.raises(SystemExit) as exit_:
        bench.env.append_records(path, [{"bench": "b"}])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == '{"bench": "b"}\n' and f"{path} is held by process {os.getpid()}" in err
    assert path.read_text() == '{"bench": "a"}\n'
    bench.env.append_records(path, [{"bench": "b"}])
    assert path.read_text() == '{"bench": "a"}\n{"bench": "b"}\n'


def test_default_run_directories_started_in_one_second_are_two(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(trainer.rundir.time, "strftime", lambda _: "20261206-120000")  # one second for all
    made = [new_run_path("debug") for _ in range(3)]
    assert [p.name for p in made] == ["debug-20261206-120000", "debug-20261206-120000-2", "debug-20261206-120000-3"]
    assert all(p.is_dir() for p in made)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert new_run_path("debug").name == "debug-20261206-120000-4242"
    monkeypatch.undo()
    code = "from trainer.rundir import new_run_path; print(new_run_path('race'))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    made = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert len(made) == 4 and all(Path(tmp_path, m).is_dir() for m in made)


def test_a_bad_lease_setting_is_one_line(tmp_path):
    proc = _holder(tmp_path, 0, **{LEASE_ENV: "soon"})
    line = _refused(proc)
    assert line == f"refused: {LEASE_ENV}='soon' must be a positive number of seconds"
