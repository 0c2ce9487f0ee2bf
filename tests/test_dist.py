import pytest

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
    assert gpu_index(local_rank, local_world_size, visible, env, srun_tasks=env is GPU_PER_TASK) == index


@pytest.mark.parametrize("env", [{}, {"CUDA_VISIBLE_DEVICES": "0,1"}])  # deepspeed --num_gpus 4 on a node with 2 GPUs
def test_ranks_that_would_share_a_gpu_are_an_error(env):
    with pytest.raises(
        DistError, match="4 ranks on this node but 2 GPU\\(s\\) visible to each.*: run one rank per GPU"
    ):
        gpu_index(3, 4, 2, env, srun_tasks=False)
    with pytest.raises(DistError, match="2 ranks on this node but 1 GPU\\(s\\) visible to each"):
        gpu_index(1, 2, 1, env, srun_tasks=False)


def test_one_visible_gpu_exported_to_every_rank_is_not_a_gpu_per_task():
    """CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node 2: each rank sees one GPU, the same one."""
    with pytest.raises(
        DistError,
        match="2 ranks on this node but 1 GPU\\(s\\) visible to each "
        "\\(CUDA_VISIBLE_DEVICES=0 for every rank\\).*--gpus-per-task 1",
    ):
        gpu_index(1, 2, 1, {"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "1"}, srun_tasks=False)
    # Inside an srun step without --gpus-per-task, the tasks of a node share what they see.
    with pytest.raises(DistError, match="visible to each"):
        gpu_index(1, 2, 1, {"CUDA_VISIBLE_DEVICES": "0", "SLURM_PROCID": "1"}, srun_tasks=True)
    # A torchrun inside a task of a --gpus-per-task job inherits its variables: its ranks still share the GPU.
    with pytest.raises(DistError, match="visible to each"):
        gpu_index(1, 2, 1, GPU_PER_TASK, srun_tasks=False)
