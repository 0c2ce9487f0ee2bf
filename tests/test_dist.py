import json
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_ARGS, single_process_env
from trainer.dist import DistEnv, first_host, gpu_index, tasks_on_node
from trainer.errors import DistError

LAUNCHED = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


def test_single_process_without_launcher():
    env = DistEnv.from_environ({})
    assert (env.rank, env.local_rank, env.world_size, env.master_addr) == (0, 0, 1, "127.0.0.1")
    assert env.is_main and 0 < env.master_port < 65536


@pytest.mark.parametrize("local_var", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])  # torchrun, deepspeed launcher
def test_from_launcher(local_var):
    env = DistEnv.from_environ({**LAUNCHED, local_var: "4"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 8, 4)
    assert (env.master_addr, env.master_port) == ("node01", 29500)
    assert not env.is_main


def test_incomplete_launcher_variables_are_named():
    with pytest.raises(DistError, match="MASTER_ADDR, MASTER_PORT missing"):
        DistEnv.from_environ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})


def test_non_integer_and_inconsistent_values():
    with pytest.raises(DistError, match="RANK='x'"):
        DistEnv.from_environ({**LAUNCHED, "RANK": "x"})
    with pytest.raises(DistError, match="inconsistent ranks from the launcher: rank 8, local rank 1, world size 8"):
        DistEnv.from_environ({**LAUNCHED, "RANK": "8"})


SRUN_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "nid[001-002]",
    "SLURM_JOB_NODELIST": "nid[001-002]",
}


def test_from_srun_task():
    env = DistEnv.from_environ(SRUN_TASK)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert env.master_addr == "nid001" and env.source == "slurm"
    assert (
        env.master_port
        == DistEnv.from_environ(
            {**SRUN_TASK, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
        ).master_port
    )
    assert env.master_port != DistEnv.from_environ({**SRUN_TASK, "SLURM_JOB_ID": "4243"}).master_port
    override = DistEnv.from_environ({**SRUN_TASK, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (override.master_addr, override.master_port) == ("head", 1234)


def test_batch_script_without_srun_is_one_process(caplog):
    # sbatch -n 8 runs the script once with SLURM_PROCID=0 and no step: a plain `python ds_train.py` there is alone.
    batch = {k: v for k, v in SRUN_TASK.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NODELIST")}
    env = DistEnv.from_environ(batch)
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")
    assert "not started by srun" in caplog.text


def test_launcher_inside_a_step_is_trusted_unless_it_contradicts_the_tasks():
    # `srun -N2 --ntasks-per-node=1 deepspeed ...`-like: the launcher's ranks differ from the step's tasks; fine.
    inside = DistEnv.from_environ({**SRUN_TASK, "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", **LAUNCHED})
    assert (inside.rank, inside.source) == (3, "launcher")
    # Every srun task told it is rank 0 (RANK exported in the batch script): the reported bug.
    with pytest.raises(DistError, match="RANK=0 contradicts SLURM_PROCID=5 .* unset RANK"):
        DistEnv.from_environ(
            {**SRUN_TASK, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
        )


def test_incomplete_slurm_step_is_named():
    partial = {k: v for k, v in SRUN_TASK.items() if k not in ("SLURM_NTASKS", "SLURM_STEP_TASKS_PER_NODE")}
    with pytest.raises(DistError, match="SLURM_NTASKS, SLURM_STEP_TASKS_PER_NODE missing"):
        DistEnv.from_environ(partial)


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("localhost", "localhost"),
        ("nid[001-004,010]", "nid001"),
        ("gpu7,gpu[1-3]", "gpu7"),
        ("rack[2-3]-n[05,07]", "rack2-n05"),
    ],
)
def test_first_host_of_a_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_tasks_per_node():
    assert [tasks_on_node("4(x2),3", i) for i in range(3)] == [4, 4, 3]
    with pytest.raises(DistError, match="cannot read"):
        tasks_on_node("4x2", 0)


# srun --gpus-per-task 1: Slurm gives each task a GPU of its own and says so.
GPU_PER_TASK = {"SLURM_GPUS_PER_TASK": "1", "SLURM_PROCID": "3", "CUDA_VISIBLE_DEVICES": "2"}


@pytest.mark.parametrize(
    "local_rank, local_world_size, visible, env, index",
    [
        (0, 1, 1, {}, 0),
        (3, 4, 1, GPU_PER_TASK, 0),
        (3, 4, 4, {}, 3),
        (1, 2, 8, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 1),
    ],
)
def test_each_rank_gets_its_own_gpu(local_rank, local_world_size, visible, env, index):
    assert gpu_index(local_rank, local_world_size, visible, environ=env, srun_tasks=env is GPU_PER_TASK) == index


@pytest.mark.parametrize("env", [{}, {"CUDA_VISIBLE_DEVICES": "0,1"}])  # deepspeed --num_gpus 4 on a node with 2 GPUs
def test_ranks_that_would_share_a_gpu_are_an_error(env):
    with pytest.raises(
        DistError, match="4 ranks on this node but 2 GPU\\(s\\) visible to each.*: run one rank per GPU"
    ):
        gpu_index(3, 4, 2, environ=env, srun_tasks=False)
    with pytest.raises(DistError, match="2 ranks on this node but 1 GPU\\(s\\) visible to each"):
        gpu_index(1, 2, 1, environ=env, srun_tasks=False)


def test_one_visible_gpu_exported_to_every_rank_is_not_a_gpu_per_task():
    """CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node 2: each rank sees one GPU, the same one."""
    with pytest.raises(
        DistError,
        match="2 ranks on this node but 1 GPU\\(s\\) visible to each "
        "\\(CUDA_VISIBLE_DEVICES=0 for every rank\\).*--gpus-per-task 1",
    ):
        gpu_index(1, 2, 1, environ={"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "1"}, srun_tasks=False)
    # Inside an srun step without --gpus-per-task, the tasks of a node share what they see.
    with pytest.raises(DistError, match="visible to each"):
        gpu_index(1, 2, 1, environ={"CUDA_VISIBLE_DEVICES": "0", "SLURM_PROCID": "1"}, srun_tasks=True)
    # A torchrun inside a task of a --gpus-per-task job inherits its variables: its ranks still share the GPU.
    with pytest.raises(DistError, match="visible to each"):
        gpu_index(1, 2, 1, environ=GPU_PER_TASK, srun_tasks=False)


# --- launch faults, provoked for real: one line each, within dist_timeout_s -------------------------------------

START = """
import json, os, sys, time
from trainer.dist import DistEnv, init_distributed
from trainer.errors import DistError
start = time.monotonic()
try:
    init_distributed(DistEnv.from_environ(), float(sys.argv[1]))
    import torch, torch.distributed as dist
    total = torch.ones(1)
    dist.all_reduce(total)
    print(json.dumps({"ranks": total.item()}), flush=True)
    if os.environ.get("HOLD_UNTIL_EOF"):  # the rendezvous stays up until the test has every outcome
        sys.stdin.read()
except DistError as err:
    print(json.dumps({"error": str(err), "s": time.monotonic() - start}))
"""


def _start(timeout_s: float, **env: str) -> subprocess.Popen:
    variables = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", **env}
    return subprocess.Popen(
        [sys.executable, "-c", START, str(timeout_s)],
        cwd=REPO,
        env={**single_process_env(), "PYTHONPATH": str(REPO), **variables},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _outcome(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_faults_are_one_line_each_within_the_timeout():
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    free = str(_free_port())  # nobody listens there
    bound = "within 2 s (dist_timeout_s, 600 s by default)"
    cases = {
        "a taken port": (
            {"MASTER_PORT": port},
            f"rank 0: the rendezvous port {port} (MASTER_PORT) is taken on this host, by another job or a second "
            "process started as rank 0: set MASTER_PORT to a free port",
        ),
        "an unresolvable host": (
            {"MASTER_PORT": free, "MASTER_ADDR": "no-such-host.invalid"},
            "rank 0: the rendezvous host no-such-host.invalid (MASTER_ADDR) cannot be resolved",
        ),
        "nobody at the rendezvous": (
            {"MASTER_PORT": free, "RANK": "1", "WORLD_SIZE": "2"},
            f"rank 1: could not reach the rendezvous 127.0.0.1:{free} {bound}",
        ),
        "a rank that never arrives": (
            {"MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"},
            "rank 0: only 1 of 2 ranks reached the rendezvous 127.0.0.1:",
        ),
        "a backend that cannot start": (
            {"MASTER_PORT": str(_free_port()), "GLOO_SOCKET_IFNAME": "nosuch0"},
            "rank 0: the gloo backend could not start: this host has no network interface nosuch0 "
            "(GLOO_SOCKET_IFNAME=nosuch0)",
        ),
        "not a port": ({"MASTER_PORT": "70000"}, "the rendezvous port 70000 (MASTER_PORT) is not a port"),
    }
    try:
        procs = {name: _start(2, **env) for name, (env, _) in cases.items()}
        outcomes = {name: _outcome(proc) for name, proc in procs.items()}
    finally:
        taken.close()
    for name, (_, expected) in cases.items():
        outcome = outcomes[name]
        assert outcome.get("error", "").startswith(expected), (name, outcome)
        assert outcome["s"] < 2 + 15, (name, outcome)  # bounded by dist_timeout_s
    assert bound in outcomes["a rank that never arrives"]["error"]


def test_ranks_started_with_one_rank_or_two_world_sizes_are_one_line_and_the_group_goes_on():
    port = str(_free_port())
    held = {"MASTER_PORT": port, "WORLD_SIZE": "2", "HOLD_UNTIL_EOF": "1"}  # a late duplicate still finds rank 0
    ranks = [_start(20, RANK=r, LOCAL_RANK=r, **held) for r in ("0", "1", "1")]
    outcomes = [next(json.loads(line) for line in p.stdout if line.startswith("{")) for p in ranks]
    for p in ranks:
        p.communicate(timeout=120)
    assert [o for o in outcomes if "error" not in o] == [{"ranks": 2.0}] * 2, outcomes  # the group of two goes on
    (twice,) = [o["error"] for o in outcomes if "error" in o]
    assert twice.startswith("rank 1 was started twice (process ") and "give each process a RANK of its own" in twice
    port = str(_free_port())
    mixed = [_start(20, MASTER_PORT=port, WORLD_SIZE=w, RANK=r, LOCAL_RANK=r) for r, w in (("0", "2"), ("1", "3"))]
    first, second = (_outcome(p)["error"] for p in mixed)
    assert "rank 0: rank 1 (" in first and "was started with WORLD_SIZE=3, not 2" in first
    assert second == "rank 1: WORLD_SIZE=3 here but 2 at rank 0: start every rank with the same WORLD_SIZE"


def test_a_run_whose_rendezvous_port_is_taken_ends_in_one_line(tmp_path):
    """As srun or torchrun would start it, with MASTER_PORT held by another process."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launched = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        result = subprocess.run(
            [sys.executable, "ds_train.py", *TINY_ARGS, "--run_dir", str(tmp_path / "run")],
            cwd=REPO,
            env={**single_process_env(), **launched, "MASTER_PORT": str(port)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert line.endswith(
        f"rank 0: the rendezvous port {port} (MASTER_PORT) is taken on this host, by another job or "
        "a second process started as rank 0: set MASTER_PORT to a free port (the launchers' --master_port)"
    )
    assert not (tmp_path / "run").exists()
