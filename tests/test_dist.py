import pytest

from trainer.dist import DistEnv, DistError

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
    with pytest.raises(DistError, match="inconsistent ranks: RANK=8"):
        DistEnv.from_environ({**LAUNCHED, "RANK": "8"})
