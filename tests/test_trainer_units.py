import pytest

from trainer.trainer import validation_share


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
