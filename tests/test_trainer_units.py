import pytest

from trainer.build import unused_data_keys, validation_share
from trainer.config import Config


@pytest.mark.parametrize(
    "num, batch, policy, world, expected",
    [
        (30, 8, "partial", 1, [(0, 30)]),
        (30, 8, "drop", 1, [(0, 24)]),
        (10, 2, "partial", 3, [(0, 4), (4, 3), (7, 3)]),  # every sample once, spread over the ranks
        (10, 2, "drop", 3, [(0, 2), (2, 2), (4, 2)]),  # whole batches only
        (2, 4, "drop", 1, [(0, 0)]),
    ],
)
def test_validation_share(num, batch, policy, world, expected):
    shares = [validation_share(num, batch, policy, rank, world) for rank in range(world)]
    assert shares == expected
    if policy == "partial":
        assert sum(count for _, count in shares) == num


def test_data_keys_that_the_storage_mode_does_not_use():
    tuned = Config(num_data_workers=8, data_prefetch=4, device_storage_dtype="float16")
    # The GPU cuts the crops: no CPU threads; the torch backend prefetches nothing there, DALI does.
    assert unused_data_keys(tuned, "device", "torch", "cuda") == ["num_data_workers", "data_prefetch"]
    assert unused_data_keys(tuned, "device", "dali", "cuda") == ["num_data_workers"]
    assert unused_data_keys(tuned, "host", "dali", "cuda") == ["device_storage_dtype"]
    assert unused_data_keys(tuned, "lazy", "torch", "cpu") == ["device_storage_dtype"]
    assert (
        unused_data_keys(Config(), "device", "dali", "cuda") == unused_data_keys(Config(), "lazy", "torch", "cpu") == []
    )
