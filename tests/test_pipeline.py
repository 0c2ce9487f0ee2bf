"""The DALI pipeline against the numpy reference, voxel for voxel, and the properties of the draws."""

import numpy as np
import pytest
import torch

from pipeline.dali import CropSource, DaliLoader
from pipeline.rotations import ROTATIONS
from pipeline.sampling import Augmenter, SampleDraw, train_draw, val_draw
from pipeline.volumes import DataError, VolumePair

CROP = 8
AUG = Augmenter(4, 5, [[1, 2, 3]], [[1, 2, 3]])


@pytest.fixture(scope="module")
def volumes(tiny_data):
    return VolumePair.open(tiny_data["train"], 4, 5, CROP, "host")


def _every_rotation(epoch: int, index: int) -> SampleDraw:
    """Cycles through all 24 rotations, with corners that differ per epoch and sample."""
    return SampleDraw(((index * 5 + epoch) % 20, (index * 3) % 24, (index * 7 + 2 * epoch) % 24), index % 24)


def _batches(loader):
    return [(inp.clone(), tar.clone()) for inp, tar in loader]


def test_dali_equals_numpy_reference_for_all_rotations_and_epochs(volumes):
    batch = 8
    loader = DaliLoader(CropSource(volumes, CROP, 48, _every_rotation, AUG), batch, None, torch.float32, 1)
    for epoch in range(2):
        batches = _batches(loader)
        assert len(batches) == len(loader) == 6
        for b, (inp, tar) in enumerate(batches):
            assert inp.shape == (batch, 4, CROP, CROP, CROP) and tar.shape == (batch, 5, CROP, CROP, CROP)
            for j in range(batch):
                ref_inp, ref_tar = AUG.reference(volumes, _every_rotation(epoch, b * batch + j), CROP)
                assert np.array_equal(inp[j].numpy(), ref_inp)
                assert np.array_equal(tar[j].numpy(), ref_tar)


def test_general_vector_layouts_match_reference(tiny_data):
    # Six target channels read as two vectors (one with components out of order): still the reference.
    vols = VolumePair.open(tiny_data["train"], 4, 5, CROP, "host")
    aug = Augmenter(5, 5, [[1, 2, 3]], [[3, 1, 2]])
    vols.nbody = np.concatenate([vols.nbody, vols.hydro[4:]])  # a fifth input channel, scalar

    loader = DaliLoader(CropSource(vols, CROP, 24, _every_rotation, aug), 24, None, torch.float32, 1)
    ((inp, tar),) = _batches(loader)
    for j in range(24):
        ref_inp, ref_tar = aug.reference(vols, _every_rotation(0, j), CROP)
        assert np.array_equal(inp[j].numpy(), ref_inp) and np.array_equal(tar[j].numpy(), ref_tar)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_in_training_dtype(volumes, dtype):
    loader = DaliLoader(CropSource(volumes, CROP, 8, _every_rotation, AUG), 8, None, dtype, 1)
    ((inp, tar),) = _batches(loader)
    assert inp.dtype == dtype and inp.is_contiguous()
    assert tar.dtype == torch.float32  # the loss's precision
    ref_inp, ref_tar = AUG.reference(volumes, _every_rotation(0, 3), CROP)
    assert torch.equal(inp[3], torch.from_numpy(ref_inp).to(dtype))
    assert torch.equal(tar[3], torch.from_numpy(ref_tar))


def test_validation_is_plain_crops(volumes):
    draw = lambda epoch, index: val_draw(0, index, volumes.box_size, CROP)  # noqa: E731
    loader = DaliLoader(CropSource(volumes, CROP, 8, draw, augmenter=None), 4, None, torch.float32, 1)
    for b, (inp, tar) in enumerate(_batches(loader)):
        for j in range(4):
            ref_inp, ref_tar = volumes.crop(draw(0, b * 4 + j).corner, CROP)
            assert np.array_equal(inp[j].numpy(), ref_inp) and np.array_equal(tar[j].numpy(), ref_tar)


def test_lazy_storage_reads_the_same_crops(tiny_data, volumes):
    lazy = VolumePair.open(tiny_data["train"], 4, 5, CROP, "lazy")
    for corner in ((0, 0, 0), (24, 3, 17)):
        for a, b in zip(lazy.crop(corner, CROP), volumes.crop(corner, CROP)):
            assert np.array_equal(a, b)


def test_draws_are_deterministic_and_differ_by_rank_and_epoch():
    def draws(seed, epoch):
        return [train_draw(seed, epoch, i, 128, 32, True) for i in range(64)]

    assert draws(10, 0) == draws(10, 0)
    assert draws(10, 0) != draws(11, 0)  # rank 1's seed is base seed + 1
    assert draws(10, 0) != draws(10, 1)
    corners = np.array([d.corner for d in draws(10, 0) + draws(10, 1)])
    assert corners.min() >= 0 and corners.max() <= 128 - 32
    assert len({d.rotation for d in draws(10, 0) + draws(10, 1) + draws(10, 2)}) == len(ROTATIONS)
    assert {d.rotation for d in (train_draw(10, 0, i, 64, 32, False) for i in range(32))} == {0}
    # Validation crops are one fixed set, whatever the rank.
    assert [val_draw(0, i, 64, 32) for i in range(8)] == [val_draw(0, i, 64, 32) for i in range(8)]


def test_epoch_length_must_fill_batches(volumes):
    with pytest.raises(ValueError, match="not a multiple of the batch size"):
        DaliLoader(CropSource(volumes, CROP, 10, _every_rotation, AUG), 4, None, torch.float32, 1)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda f: f.__delitem__("Hydro"), "no dataset 'Hydro'"),
        (lambda f: (f.__delitem__("Nbody"), f.create_dataset("Nbody", data=np.zeros((3, 8, 8, 8), np.float32))), "has 3 channels"),
        (lambda f: (f.__delitem__("Nbody"), f.create_dataset("Nbody", data=np.zeros((4, 8, 8, 4), np.float32))), "expected \\(channels, L, L, L\\)"),
        (lambda f: (f.__delitem__("Nbody"), f.create_dataset("Nbody", data=np.zeros((4, 32, 32, 32), np.int16))), "expected floating point"),
        (lambda f: (f.__delitem__("Nbody"), f.create_dataset("Nbody", data=np.zeros((4, 16, 16, 16), np.float32))), "cover different boxes"),
    ],
)  # fmt: skip
def test_bad_files_are_named(tmp_path, tiny_data, mutate, message):
    import h5py
    import shutil

    path = tmp_path / "bad.h5"
    shutil.copy(tiny_data["val"], path)
    with h5py.File(path, "a") as f:
        mutate(f)
    with pytest.raises(DataError, match=message) as err:
        VolumePair.open(path, 4, 5, CROP, "host")
    assert str(path) in str(err.value)


def test_missing_corrupt_and_too_small(tmp_path, tiny_data):
    with pytest.raises(DataError, match="no such data file"):
        VolumePair.open(tmp_path / "nope.h5", 4, 5, CROP, "host")
    (tmp_path / "junk.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        VolumePair.open(tmp_path / "junk.h5", 4, 5, CROP, "host")
    with pytest.raises(DataError, match="larger than the box"):
        VolumePair.open(tiny_data["val"], 4, 5, 64, "host")
