"""Two nodes for real, on one machine: slurm/train.sbatch on a two-node Slurm cluster (tests/slurm/cluster.sh), one
rank per node, through both of its launch styles; a rank that dies on the second node; a stop on the time-limit
signal, the requeue and an exact resume across the two nodes.

The nodes are node1 (127.0.0.2) and node2 (127.0.0.3): two slurmd daemons, each in a UTS namespace of its own, so
that a rank's hostname is its node's. How that is set up is in tests/slurm/README.md.
"""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_distributed import (
    _job_args,
    _kill_rank_and_wait,
    _sbatch,
    _stop_on_the_time_limit_signal,
    _summary,
    _wait,
    _wait_for_training,
    slurm_cluster,
)

NODES = ["node1", "node2"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    # Ports of its own: the one-node cluster of test_distributed.py may still be up.
    yield from slurm_cluster(tmp_path_factory.mktemp("slurm2"), nodes=2, ports=(16827, 16828))


def _two_node_job(env, tmp_path, launcher, epochs):
    return _sbatch(env, tmp_path, {"LAUNCHER": launcher}, *_job_args(tmp_path, epochs), nodes=2, tasks_per_node=1)


# The deepspeed launcher across nodes goes through DeepSpeed's Slurm launcher (DS_LAUNCHER=slurm, the script's
# default there), which starts the ranks with srun: they find their ranks from Slurm's variables too.
@pytest.mark.parametrize("launcher", ["srun", "deepspeed"])
def test_two_nodes_train_one_rank_each(two_nodes, tmp_path, launcher):
    job = _two_node_job(two_nodes, tmp_path, launcher, epochs=2)
    state, exit_code = _wait(two_nodes, job)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), log[-3000:]
    assert "2 node(s) [node[1-2]], 2 task(s)" in log
    assert "rank 0 of 2 on node1 (local rank 0 of 1 on this node)" in log
    (run,) = (tmp_path / "runs").glob(f"cosmo-emulator-{job}")
    summary = _summary(run)
    assert summary["world_size"] == 2 and summary["rank_hosts"] == NODES  # one rank on each node
    assert summary["rendezvous"].startswith("node1:")  # the first node of the allocation
    weights, batches = summary["rank_weight_digests"], summary["rank_first_batch_digests"]
    assert weights[0] == weights[1] and batches[0] != batches[1]  # in sync, with crops of their own
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def test_killing_the_rank_on_the_second_node_fails_the_job_within_90_s(two_nodes, tmp_path):
    job = _two_node_job(two_nodes, tmp_path, "srun", epochs=200)
    _wait_for_training(tmp_path / "runs")
    state, exit_code, took = _kill_rank_and_wait(two_nodes, job, SLURMD_NODENAME="node2")
    assert state == "FAILED" and exit_code != "0:0" and took < 90


def test_a_stop_on_the_time_limit_signal_requeues_and_resumes_exactly_on_two_nodes(two_nodes, tmp_path):
    straight = _two_node_job(two_nodes, tmp_path, "srun", epochs=4)
    assert _wait(two_nodes, straight)[0] == "COMPLETED"
    job = _two_node_job(two_nodes, tmp_path, "srun", epochs=4)
    resumed = _stop_on_the_time_limit_signal(two_nodes, tmp_path, job)
    expected = _summary(tmp_path / "runs" / f"cosmo-emulator-{straight}")
    assert resumed["resumed_from"] is not None and resumed["rank_hosts"] == NODES
    assert resumed["final_val_loss"] == expected["final_val_loss"]  # bit for bit: the same run, interrupted
    assert resumed["rank_weight_digests"] == expected["rank_weight_digests"]


def test_the_weak_scaling_sweep_runs_its_two_rank_case_across_the_nodes(two_nodes, tmp_path):
    out = tmp_path / "train.jsonl"
    sweep = ["--preset", "cpu-smoke", "--only", "weak", "--scaling_repeats", "1", "--steps", "4", "--warmup", "2"]
    job = subprocess.run(
        ["sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "1", "-o", str(tmp_path / "bench-%j.out")]
        + ["slurm/bench.sbatch", *sweep, "--out", str(out), "--no_report", "--backend", "torch"],
        cwd=REPO,
        env={**two_nodes, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    state, exit_code = _wait(two_nodes, job, timeout=300)
    assert (state, exit_code) == ("COMPLETED", "0:0"), (tmp_path / f"bench-{job}.out").read_text()[-3000:]
    records = {r["world_size"]: r for r in map(json.loads, out.read_text().splitlines()) if r["mode"] == "synthetic"}
    assert sorted(records) == [1, 2]
    assert records[1]["nodes"] == ["node1"] and records[2]["nodes"] == NODES  # one rank on each node
    assert all(r["samples_per_s"] > 0 and r["sweep"] == "weak" for r in records.values())
