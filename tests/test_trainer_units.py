import pytest

from trainer.config import Config
from trainer.data import unused_data_keys, validation_share


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
    shares = [validation_share(num, batch, policy, rank=rank, world_size=world) for rank in range(world)]
    assert shares == expected
    if policy == "partial":
        assert sum(count for _, count in shares) == num


def test_data_keys_that_the_storage_mode_does_not_use():
    from pipeline.storage import DEVICE, HOST, LAZY

    tuned = Config(num_data_workers=8, data_prefetch=4, device_storage_dtype="float16")
    # The GPU cuts the crops: no CPU threads; the torch backend prefetches nothing there, DALI does.
    assert unused_data_keys(tuned, DEVICE, "torch", device_type="cuda") == ["num_data_workers", "data_prefetch"]
    assert unused_data_keys(tuned, DEVICE, "dali", device_type="cuda") == ["num_data_workers"]
    assert unused_data_keys(tuned, HOST, "dali", device_type="cuda") == ["device_storage_dtype"]
    assert unused_data_keys(tuned, LAZY, "torch", device_type="cpu") == ["device_storage_dtype"]
    assert (
        unused_data_keys(Config(), DEVICE, "dali", device_type="cuda")
        == unused_data_keys(Config(), LAZY, "torch", device_type="cpu")
        == []
    )


def test_a_micro_batch_that_does_not_fit_is_one_line_saying_what_to_lower():
    """torch's message for a CUDA allocation that fails (its wording in torch 2.x), read for what was asked and what
    was free; a message without them still names the micro-batch and what to lower."""
    import torch

    from trainer.errors import out_of_memory

    torch_says = (
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.50 GiB "
        "is free. Including non-PyTorch memory, this process has 138.30 GiB memory in use. Of the allocated memory "
        "130.00 GiB is allocated by PyTorch, and 7.00 GiB is reserved by PyTorch but unallocated."
    )
    where = "epoch 1, batch 1, after step 0"
    line = str(out_of_memory(torch.OutOfMemoryError(torch_says), 1024, 64, device="cuda:0 (NVIDIA H200)", where=where))
    assert line == (
        "a micro-batch of 1024 crops of 64^3 does not fit in the memory of cuda:0 (NVIDIA H200) at epoch 1, batch 1, "
        "after step 0 (20.00 GiB asked, 1.50 GiB free of 139.81 GiB): lower micro_batch_size (gradient accumulation "
        "keeps the global batch) or data_size"
    )
    bare = str(out_of_memory(torch.OutOfMemoryError("out of memory"), 8, 32, device="cuda:1", where=where))
    assert bare.startswith("a micro-batch of 8 crops of 32^3 does not fit in the memory of cuda:1 at epoch 1, batch 1")
    assert "): lower" not in bare and ": lower micro_batch_size" in bare
    resident = str(
        out_of_memory(torch.OutOfMemoryError(torch_says), 64, 64, device="cuda:0", where=where, volumes="31.50 GiB")
    )
    assert (
        "free of 139.81 GiB): set storage: host (the volumes take 31.50 GiB of it), or lower micro_batch_size"
        in resident
    )
    assert "\n" not in line + bare + resident


def test_channels_last_is_on_by_default_with_a_gpu_only():
    from trainer.config import channels_last_on

    assert channels_last_on(Config(), "cuda") is True and channels_last_on(Config(), "cpu") is False
    assert channels_last_on(Config(channels_last=False), "cuda") is False
    assert channels_last_on(Config(channels_last=True), "cpu") is True


def test_a_resume_sets_aside_what_was_logged_beyond_it_and_any_record_cut_short(tmp_path):
    from trainer.runlog import _set_aside_beyond

    metrics, aside = tmp_path / "metrics.jsonl", tmp_path / "metrics.abandoned.jsonl"
    metrics.write_text('{"step": 0}\n{"step": 8}\n{"step": 16}\n{"step": 2')  # a crash in the middle of a record
    _set_aside_beyond(metrics, aside, 8)
    assert metrics.read_text() == '{"step": 0}\n{"step": 8}\n'
    assert aside.read_text() == '{"step": 16}\n{"step": 2\n'
    metrics.write_text('{"step": 0}\n{"step": 4}')  # nothing beyond, but no whole last line: the next record is whole
    _set_aside_beyond(metrics, aside, 8)
    assert metrics.read_text() == '{"step": 0}\n{"step": 4}\n' and aside.read_text().count("\n") == 2
