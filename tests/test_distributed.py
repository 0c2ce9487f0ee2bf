"""Several ranks for real: the deepspeed launcher on CPU, and slurm/train.sbatch on a local Slurm cluster."""

import fcntl
import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest
import torch

from pipeline.shared import PREFIX as SHARED_PREFIX
from pipeline.shared import reclaim_stale
from tests.conftest import REPO, run_train, shared_tiny_args, single_process_env

DEEPSPEED = [sys.executable, "-m", "deepspeed.launcher.runner"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=single_process_env(), capture_output=True, text=True, timeout=300)


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_a_timed_cadence_saves_where_every_rank_agrees(tmp_path):
    """Two ranks, a clock always due: each log point (every 4 steps) is a save that both ranks make at the same step
    (a rank that disagreed would leave the other in DeepSpeed's collective save)."""
    run = tmp_path / "run"
    cadence = ["--checkpoint_every_epochs", "0", "--checkpoint_every_minutes", "0.0001", "--checkpoint_keep", "8"]
    args = shared_tiny_args(tmp_path, run, "--num_epochs", "1", "--log_every_steps", "4", *cadence, data="dist-data")
    result = _run([*TORCHRUN, "ds_train.py", *args])
    assert result.returncode == 0, result.stderr[-3000:]
    saved = re.findall(r"checkpoint (step\d+) saved", (run / "train.log").read_text())
    assert saved == ["step00000004", "step00000008", "step00000012", "step00000016"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", *saved]


LAUNCHERS = {"deepspeed": [*DEEPSPEED, "--num_gpus", "2"], "torchrun": TORCHRUN}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Two ranks training the tiny config for two epochs (host storage, the debug config's), once per launcher,
    shared by the tests that read them: (the launcher's result, the run directory)."""
    done = {}

    def run(launcher):
        if launcher not in done:
            root = tmp_path_factory.mktemp(launcher)
            args = shared_tiny_args(root, root / "run", "--num_epochs", "2", data="dist-data")
            done[launcher] = (_run([*LAUNCHERS[launcher], "ds_train.py", *args]), root / "run")
        return done[launcher]

    return run


def test_two_ranks_share_one_host_copy_and_draw_the_samples_of_their_own_reads(tmp_path, two_rank_runs):
    """Host storage on a node of two ranks: one copy in shared memory, read by the first rank; each rank's batches and
    the weights equal those of the same run reading its crops from the file itself (lazy), and nothing stays in
    /dev/shm."""
    result, host = two_rank_runs("deepspeed")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "of volumes, one copy per node" in (host / "train.log").read_text()
    lazy = tmp_path / "lazy"
    args = shared_tiny_args(tmp_path, lazy, "--num_epochs", "2", "--storage", "lazy", data="dist-data")
    result = _run([*LAUNCHERS["deepspeed"], "ds_train.py", *args])
    assert result.returncode == 0, result.stderr[-3000:]
    # read lazily from a contiguous HDF5 file: said once, with the command that converts it
    (line,) = [line for line in (lazy / "train.log").read_text().splitlines() if "storage 'lazy' reads each" in line]
    assert f"python -m pipeline.convert {args[args.index('--train_path') + 1]} " in line
    assert "--data_format npy --npy_layout bricks" in line
    for key in ("rank_first_batch_digests", "rank_weight_digests", "final_val_loss"):
        assert _summary(host)[key] == _summary(lazy)[key], key
    # nothing left that no process maps (a test running beside this one may map segments of its own)
    assert reclaim_stale([SHARED_PREFIX, "deepspeed_allreduce_buffer_"]) == []


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_two_ranks_through_a_launcher(launcher, two_rank_runs):
    result, run = two_rank_runs(launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = _summary(run)
    assert (summary["world_size"], summary["launched_by"]) == (2, "launcher")
    assert (summary["micro_batch"], summary["accumulation"], summary["global_batch"]) == (4, 1, 8)
    assert summary["micro_batch"] * summary["accumulation"] * summary["world_size"] == summary["global_batch"]
    weights, batches = summary["rank_weight_digests"], summary["rank_first_batch_digests"]
    assert len(weights) == 2 and weights[0] == weights[1]  # the ranks ended in sync
    assert batches[0] != batches[1]  # and drew different crops
    for record in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()):
        if "loss/train" in record:
            per_rank = record["loss/train_per_rank"]
            assert record["loss/train"] == pytest.approx(sum(per_rank) / 2, rel=1e-12)  # the mean, not rank 0's
            assert per_rank[0] != per_rank[1]


def _launch_two_ranks(args):
    result = _run([*DEEPSPEED, "--num_gpus", "2", "ds_train.py", *args])
    assert result.returncode == 0, result.stderr[-3000:]


def _files(directory):
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_zero_stages_train_like_stage_0_and_resume_on_as_many_ranks(tmp_path, two_rank_runs):
    """ZeRO stages 1 and 2 (ds_configs/ds_fp16_zero*.json; fp32 on a CPU) split the optimizer over the ranks and
    end on stage 0's weights (the two-rank run of the deepspeed launcher), bit for bit; so does stage 0 with its
    reduction overlapped with backward in small buckets, stopped and resumed with DeepSpeed's own reduction. A stopped
    stage-2 run resumes exactly on its 2 ranks; on 1 rank it is one clear line (DeepSpeed cannot split its optimizer
    states anew), the checkpoint kept."""
    result, stage_0 = two_rank_runs("deepspeed")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {0: stage_0, **{stage: tmp_path / f"zero{stage}" for stage in (1, 2, "overlapped")}}
    overlapped = ["--gradient_reduction", "overlapped", "--reduce_bucket_mb", "0.002", "--stop_after_epoch", "1"]
    _launch_two_ranks(
        shared_tiny_args(tmp_path, runs["overlapped"], "--num_epochs", "2", *overlapped, data="dist-data")
    )
    _launch_two_ranks(["--run_dir", str(runs["overlapped"]), "--resume", "--gradient_reduction", "after_backward"])
    zero_json = {1: "ds_configs/ds_fp16_zero1.json", 2: "ds_configs/ds_fp16_zero2.json"}
    _launch_two_ranks(
        shared_tiny_args(tmp_path, runs[1], "--num_epochs", "2", "--deepspeed_config", zero_json[1], data="dist-data")
    )
    stopped = ["--num_epochs", "2", "--deepspeed_config", zero_json[2], "--stop_after_epoch", "1"]
    _launch_two_ranks(shared_tiny_args(tmp_path, runs[2], *stopped, data="dist-data"))
    checkpoints = _files(runs[2] / "checkpoints")
    one_rank = run_train(["--run_dir", str(runs[2]), "--resume"])
    assert one_rank.returncode != 0
    assert "holds ZeRO optimizer states split over 2 rank(s), this run has 1: resume on 2 rank(s)" in one_rank.stderr
    assert "Traceback" not in one_rank.stderr
    assert _files(runs[2] / "checkpoints") == checkpoints
    _launch_two_ranks(["--run_dir", str(runs[2]), "--resume"])
    summaries = {stage: _summary(run) for stage, run in runs.items()}
    assert [s["zero_stage"] for s in summaries.values()] == [0, 1, 2, 0]
    assert summaries[2]["resumed_from"] == {"epoch": 1, "batch_in_epoch": 0} and summaries[2]["steps"] == 32
    weights = {stage: s["rank_weight_digests"] for stage, s in summaries.items()}
    assert weights[0][0] == weights[0][1] and weights[1] == weights[0] and weights[2] == weights[0]
    assert weights["overlapped"] == weights[0] and summaries["overlapped"]["steps"] == 32
    assert summaries[0]["final_val_loss"] < summaries[0]["initial_val_loss"]


def test_accumulation_is_the_mathematics_of_more_ranks(tmp_path):
    """One rank accumulating 4 micro-batches drawn as 4 ranks would draw them (accumulate_as_ranks) ends where 4 ranks
    end, to float rounding: what a global batch larger than the ranks at hand learns is what more ranks learn."""
    short = ["--num_epochs", "1", "--Nsamples", "64", "--checkpoint_keep", "1"]
    ranks, accumulated = tmp_path / "ranks", tmp_path / "accumulated"
    result = _run([*DEEPSPEED, "--num_gpus", "4", "ds_train.py", *shared_tiny_args(tmp_path, ranks, *short)])
    assert result.returncode == 0, result.stderr[-3000:]
    options = [*short, "--micro_batch_size", "2", "--accumulate_as_ranks", "true"]
    result = run_train(shared_tiny_args(tmp_path, accumulated, *options))
    assert result.returncode == 0, result.stderr[-3000:]
    by_ranks, by_accumulation = _summary(ranks), _summary(accumulated)
    assert (by_ranks["world_size"], by_ranks["accumulation"]) == (4, 1)
    assert (by_accumulation["world_size"], by_accumulation["micro_batch"], by_accumulation["accumulation"]) == (1, 2, 4)
    weights = [
        torch.load(next((run / "checkpoints").glob("step*/mp_rank_00_model_states.pt")), weights_only=False)["module"]
        for run in (ranks, accumulated)
    ]
    for name, tensor in weights[0].items():
        assert torch.allclose(tensor, weights[1][name], rtol=1e-4, atol=1e-6), name
    assert by_accumulation["final_val_loss"] == pytest.approx(by_ranks["final_val_loss"], rel=1e-4)
    assert by_ranks["final_val_loss"] < by_ranks["initial_val_loss"]


def test_a_dead_rank_ends_the_job_promptly(tmp_path):
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            *DEEPSPEED,
            "--num_gpus",
            "2",
            "ds_train.py",
            *shared_tiny_args(tmp_path, run, "--num_epochs", "200", data="dist-data"),
        ],
        cwd=REPO,
        env=single_process_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists() or "loss/train" not in (run / "metrics.jsonl").read_text():
            assert launcher.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.5)
        rank1 = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "--local_rank=1" in p.cmdline()]
        assert len(rank1) == 1
        rank1[0].kill()  # SIGKILL: no chance to clean up, as when a node dies
        killed = time.time()
        code = launcher.wait(timeout=60)
        assert code != 0
        assert time.time() - killed < 60
    finally:
        for p in psutil.Process(launcher.pid).children(recursive=True) if launcher.poll() is None else []:
            p.kill()
        launcher.kill()


# --- a real Slurm cluster on this machine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Starts a one-node Slurm cluster (tests/slurm/cluster.sh), or skips saying why it cannot."""
    yield from slurm_cluster(tmp_path_factory.mktemp("slurm"), nodes=1)


def slurm_cluster(state, nodes, ports=(16817, 16818)):
    """A Slurm cluster of ``nodes`` nodes on this machine for the tests that use it (its SLURM_CONF in the
    environment they get), stopped after them; the tests are skipped, saying why, where it cannot start. One cluster
    at a time on a machine: test files run side by side (pytest -n) wait for it, as they share one munged and
    number their jobs alike."""
    with open("/tmp/cosmo-emulator-tests-slurm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _slurm_cluster(state, nodes, ports)


def _slurm_cluster(state, nodes, ports):
    script = REPO / "tests" / "slurm" / "cluster.sh"
    env = {**os.environ, "SLURMCTLD_PORT": str(ports[0]), "SLURMD_PORT": str(ports[1])}
    started = subprocess.run(
        ["bash", str(script), "start", str(state), str(nodes)], env=env, capture_output=True, text=True, timeout=60
    )
    if started.returncode != 0:
        subprocess.run(["bash", str(script), "stop", str(state)], capture_output=True)
        pytest.skip(f"no local {nodes}-node Slurm cluster: {started.stderr.strip() or started.stdout.strip()}")
    yield {**single_process_env(), "SLURM_CONF": str(state / "slurm.conf")}
    subprocess.run(["bash", str(script), "stop", str(state)], capture_output=True, timeout=60)


def _sbatch(env, tmp_path, extra_env, *args, nodes=1, tasks_per_node=2):
    env = {**env, "RUNS_DIR": str(tmp_path / "runs"), "PYTHON": sys.executable, **extra_env}
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-N",
            str(nodes),
            "--ntasks-per-node",
            str(tasks_per_node),
            "-o",
            str(tmp_path / "job-%j.out"),
            "slurm/train.sbatch",
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def _job_args(tmp_path, epochs):
    """The tiny run's arguments without --run_dir: the batch script names the run directory."""
    args = shared_tiny_args(tmp_path, "unused", "--num_epochs", str(epochs), data="dist-data")
    i = args.index("--run_dir")
    return args[:i] + args[i + 2 :]


def _wait_for_training(runs_dir, timeout=120, job="*"):
    """Until a run (job ``job``'s) under ``runs_dir`` has logged a training loss."""
    deadline = time.time() + timeout
    while True:
        metrics = list(runs_dir.glob(f"cosmo-emulator-{job}/metrics.jsonl")) if runs_dir.exists() else []
        if metrics and "loss/train" in metrics[0].read_text():
            return
        assert time.time() < deadline, "training did not start"
        time.sleep(0.1)


def _wait(env, job, timeout=240):
    """Poll scontrol (sbatch --wait polls slowly) until the job ends; its state and exit code."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return fields["JobState"], fields["ExitCode"]
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} did not end within {timeout} s")


@pytest.mark.parametrize("launcher, launched_by", [("srun", "slurm"), ("deepspeed", "launcher")])
def test_sbatch_trains_with_two_tasks(slurm, tmp_path, launcher, launched_by):
    job = _sbatch(slurm, tmp_path, {"LAUNCHER": launcher}, *_job_args(tmp_path, 2))
    state, exit_code = _wait(slurm, job)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), log[-3000:]
    (run,) = (tmp_path / "runs").glob(f"cosmo-emulator-{job}")
    summary = _summary(run)
    assert (summary["world_size"], summary["launched_by"]) == (2, launched_by)
    assert summary["rank_weight_digests"][0] == summary["rank_weight_digests"][1]
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def _kill_rank_and_wait(env, job, **where):
    """SIGKILL the one rank of ``job`` whose Slurm variables match ``where`` (no chance to clean up, as when its node
    dies); the job's end state, exit code and the seconds it took to end."""
    victims = [
        p
        for p in psutil.process_iter(["environ"])
        if (p.info["environ"] or {}).get("SLURM_JOB_ID") == job
        and all((p.info["environ"] or {}).get(key) == value for key, value in where.items())
        and "ds_train.py" in " ".join(p.cmdline())
    ]
    assert len(victims) == 1, f"no single rank of job {job} with {where}"
    victims[0].kill()
    killed = time.time()
    state, exit_code = _wait(env, job, timeout=90)
    return state, exit_code, time.time() - killed


def test_sbatch_job_fails_when_a_task_dies(slurm, tmp_path):
    job = _sbatch(slurm, tmp_path, {"LAUNCHER": "srun"}, *_job_args(tmp_path, 200))
    _wait_for_training(tmp_path / "runs")
    state, exit_code, took = _kill_rank_and_wait(slurm, job, SLURM_PROCID="1")
    assert state == "FAILED" and exit_code != "0:0" and took < 90


def test_hostfile_from_the_allocation(slurm, tmp_path):
    script = tmp_path / "hostfile.sh"
    script.write_text(
        f"#!/bin/bash\ncd {REPO}\nGPUS_PER_NODE=3 bash slurm/make_hostfile.sh\nbash slurm/make_hostfile.sh\n"
    )
    out = subprocess.run(
        ["sbatch", "--parsable", "-n", "2", "-o", str(tmp_path / "h.out"), str(script)],
        env=slurm,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert _wait(slurm, out)[0] == "COMPLETED"
    assert (tmp_path / "h.out").read_text().splitlines() == ["localhost slots=3", "localhost slots=2"]


def _stop_on_the_time_limit_signal(env, tmp_path, job):
    """What `--signal=B:USR1@300` does before the time limit, sent now (the batch shell gets SIGUSR1); once the job
    has requeued itself and finished, its summary."""
    _wait_for_training(tmp_path / "runs", job=job)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)
    time.sleep(2)  # let the requeue happen before polling for the end
    state, exit_code = _wait(env, job, timeout=180)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), log[-3000:]
    assert "requeueing job" in log and "(restart 1)" in log and "--resume" in log
    return _summary(tmp_path / "runs" / f"cosmo-emulator-{job}")


def test_a_save_failing_on_one_rank_ends_every_rank_at_once(tmp_path):
    """Two ranks; only rank 0 writes the stage-0 checkpoint, under a file size limit it cannot meet (SIGXFSZ
    ignored: writes fail). Rank 1, which would wait at DeepSpeed's barrier until the collective timeout, ends with
    it: one line each, long before dist_timeout_s, the first checkpoint and latest untouched."""
    run = tmp_path / "run"
    first = _run(
        [
            *TORCHRUN,
            "ds_train.py",
            *shared_tiny_args(tmp_path, run, "--num_epochs", "2", "--stop_after_epoch", "1", data="dist-data"),
        ]
    )
    assert first.returncode == 0, first.stderr[-3000:]
    largest = max(p.stat().st_size for p in (run / "checkpoints" / "step00000016").iterdir())
    # storage lazy: the limit would also refuse host storage's shared copy, a file in /dev/shm
    rank0_limited = (
        f"trap '' XFSZ; if [ \"$RANK\" = 0 ]; then ulimit -f {largest // 1024 // 2}; fi; "
        f"exec {sys.executable} ds_train.py --run_dir {run} --resume --dist_timeout_s 600 --storage lazy"
    )
    start = time.time()
    result = _run([*TORCHRUN, "--no-python", "bash", "-c", rank0_limited])
    assert result.returncode != 0 and time.time() - start < 120, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if " ERROR saving checkpoint step00000032" in line]
    assert len(errors) == 2, result.stderr[-3000:]  # one per rank
    assert "failed on another rank" in "".join(errors) and "ulimit -f" in "".join(errors)
    assert (run / "checkpoints" / "latest").read_text() == "step00000016"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step00000016"]
