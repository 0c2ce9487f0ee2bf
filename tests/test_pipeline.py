"""The CPU paths: every backend, storage mode and format against the numpy reference, voxel for voxel.

The device paths (rotation by DALI operators or torch ops, crops cut from resident volumes) are in
test_device_paths.py.
"""

import h5py
import numpy as np
import pytest
import torch

from common.outputs import MARK
from pipeline.bricks import to_bricks
from pipeline.crops import CropBatcher
from pipeline.dali import BatcherCrops, DaliLoader
from pipeline.loaders import LoaderSettings, build_loader, resolve_backend
from pipeline.rotations import ROTATIONS
from pipeline.sampling import Augmenter, DrawPlan, train_draw, val_draw
from pipeline.storage import STORAGES
from pipeline.volumes import DataError, VolumeFiles, VolumePair
from tests.conftest import EveryRotation

CROP = 8
AUG = Augmenter(in_channels=4, out_channels=5, in_vectors=[[1, 2, 3]], out_vectors=[[1, 2, 3]])
CPU = torch.device("cpu")


def _plan(num_samples=48, batch_size=8, cls=EveryRotation, **kw):
    return cls(seed=0, num_samples=num_samples, batch_size=batch_size, box_size=32, crop_size=CROP, rotate=True, **kw)


@pytest.fixture(scope="module")
def volumes(tiny_data):
    return VolumePair.open(VolumeFiles.hdf5(tiny_data["train"]), 4, 5, crop_size=CROP).load()


def _epoch(loader):
    return [(inputs.clone(), targets.clone()) for inputs, targets in loader]


def _check_against_reference(loader, plan, volumes, epochs=2):
    for epoch in range(epochs):
        batches = _epoch(loader)
        assert len(batches) == len(loader) == plan.num_batches
        for b, (inputs, targets) in enumerate(batches):
            draws = plan.batch_draws(epoch, b)
            assert inputs.shape == (len(draws), 4, CROP, CROP, CROP) and targets.shape == (
                len(draws),
                5,
                CROP,
                CROP,
                CROP,
            )
            for j, draw in enumerate(draws):
                ref_inp, ref_tar = AUG.reference(volumes, draw, CROP)
                assert np.array_equal(inputs[j].numpy(), ref_inp), (epoch, b, j, draw)
                assert np.array_equal(targets[j].numpy(), ref_tar), (epoch, b, j, draw)


def _batcher(volumes, plan, rotate_here, hold=2):
    return CropBatcher(volumes, plan, AUG, rotate_here=rotate_here, threads=2, lookahead=2, hold=hold)


# The CPU path: the batcher rotates while cutting (the reference code itself), DALI or torch deliver.
def test_dali_with_rotating_batcher(volumes):
    plan = _plan()
    loader = DaliLoader(
        plan=plan, augmenter=AUG, crops=BatcherCrops(_batcher(volumes, plan, True)), device_id=None, dtype=torch.float32
    )
    _check_against_reference(loader, plan, volumes)


def test_cpu_batches_of_the_torch_backend_are_read_in_place_and_stay_intact_through_the_next_one(volumes):
    """No copy after the batcher's: a batch is a view of its ring, which it does not cut into again before the
    consumer has asked for the batch after next (a training step reads its batch while the next is prepared)."""
    plan = _plan(num_samples=64, batch_size=8)
    for lookahead in (0, 1, 3):
        loader = build_loader(
            volumes,
            plan,
            AUG,
            settings=LoaderSettings(
                backend="torch", storage="host", device_storage_dtype="float32", threads=2, lookahead=lookahead
            ),
            device=CPU,
            dtype=torch.float32,
        )
        previous, buffers = None, set()
        for b, (inputs, targets) in enumerate(loader):
            buffers.add(inputs.untyped_storage().data_ptr())
            if previous is not None:  # the batch before this one, untouched although this one was cut since
                for j, draw in enumerate(plan.batch_draws(0, b - 1)):
                    ref_inp, ref_tar = AUG.reference(volumes, draw, CROP)
                    assert np.array_equal(previous[0][j].numpy(), ref_inp) and np.array_equal(
                        previous[1][j].numpy(), ref_tar
                    )
            previous = (inputs, targets)
        loader.close()
        assert len(buffers) == lookahead + 2  # the ring's buffers, reused: no new tensor per batch


@pytest.mark.parametrize("backend", ["dali", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inputs_in_training_dtype_targets_in_float32(volumes, backend, dtype):
    plan = _plan(num_samples=8)
    settings = LoaderSettings(backend=backend, storage="host", device_storage_dtype="float32", threads=1, lookahead=1)
    loader = build_loader(volumes, plan, AUG, settings=settings, device=CPU, dtype=dtype)
    ((inputs, targets),) = _epoch(loader)
    assert inputs.dtype == dtype and inputs.is_contiguous() and targets.dtype == torch.float32
    ref_inp, ref_tar = AUG.reference(volumes, plan.batch_draws(0, 0)[3], CROP)
    assert torch.equal(inputs[3], torch.from_numpy(ref_inp).to(dtype)) and torch.equal(
        targets[3], torch.from_numpy(ref_tar)
    )


def _npy_files(tmp_path, volumes, layout):
    paths = []
    for name, volume in (("data", volumes.nbody), ("label", volumes.hydro)):
        path = tmp_path / f"{name}_{layout}.npy"
        if layout == "bricks":
            np.save(path, to_bricks(volume, 8))  # 4 x 4 x 4 bricks: crops straddle them
        else:
            np.save(path, volume if layout == "CDHW" else np.ascontiguousarray(volume.transpose(1, 2, 3, 0)))
        paths.append(path)
    return VolumeFiles.npy(*paths, layout)


def test_every_storage_mode_format_and_backend_gives_the_reference_samples(tmp_path, tiny_data, volumes):
    """All 24 rotations, corners all over the box and a short last batch, for two epochs: every sample of every
    way to make it equals the numpy reference, voxel for voxel (so a wrong rotation, vector sign or corner fails)."""
    plan = _plan(num_samples=28, batch_size=8)
    sources = {
        "hdf5": VolumeFiles.hdf5(tiny_data["train"]),
        "npy CDHW": _npy_files(tmp_path, volumes, "CDHW"),
        "npy DHWC": _npy_files(tmp_path, volumes, "DHWC"),
        "npy bricks": _npy_files(tmp_path, volumes, "bricks"),
    }
    for files in sources.values():
        opened = VolumePair.open(files, 4, 5, crop_size=CROP)
        for backend in ("dali", "torch"):
            # 'device' runs here on the CPU: the volumes held by DALI's gathering function, or by torch's gather.
            for storage in ("lazy", "host", "device"):
                settings = LoaderSettings(
                    backend=backend, storage=storage, device_storage_dtype="float32", threads=2, lookahead=2
                )
                loader = build_loader(opened, plan, AUG, settings=settings, device=CPU, dtype=torch.float32)
                _check_against_reference(loader, plan, volumes)
                loader.close()


def test_device_storage_falls_back_to_host_without_a_gpu(caplog):
    assert STORAGES["device"].for_device("cpu") is STORAGES["host"]
    assert "needs a GPU" in caplog.text
    assert STORAGES["device"].for_device("cuda") is STORAGES["device"]
    assert STORAGES["lazy"].for_device("cpu") is STORAGES["lazy"]


def test_the_automatic_backend_is_dali_on_a_gpu_and_torch_on_a_cpu():
    assert [resolve_backend("auto", "cuda", storage) for storage in ("lazy", "host", "device")] == [
        "dali",
        "dali",
        "torch",  # volumes resident on the GPU: the same cutter, without DALI's copies
    ]
    assert resolve_backend("auto", "cpu", "host") == "torch"
    assert (resolve_backend("dali", "cpu", "host"), resolve_backend("torch", "cuda", "lazy")) == ("dali", "torch")


def test_batcher_works_ahead_across_epochs_and_reports_errors(volumes):
    plan = _plan(num_samples=16, batch_size=8)
    batcher = _batcher(volumes, plan, True)
    first = batcher.get(0, 0)
    assert len(first.draws) == 8 and first.rotated
    assert set(batcher._pending) == {(0, 1), (1, 0)}  # the rest of the epoch and the next one's start
    assert batcher.get(5, 1).draws == plan.batch_draws(5, 1)  # a jump is served too
    bad = CropBatcher(
        volumes, _plan(num_samples=8, batch_size=8, cls=DrawPlan, validation=True), AUG, rotate_here=True, threads=1
    )
    bad.volumes = VolumePair(volumes.files, volumes.nbody[:, :4], volumes.hydro)  # crops out of range
    with pytest.raises(ValueError):
        bad.get(0, 0)


class CopyInFlight:
    """Stands for the CUDA event after an asynchronous copy of a batch to the GPU: until it synchronizes,
    the batch's buffer must keep what the copy reads."""

    def __init__(self, batch):
        self.batch, self.expected, self.done = batch, (batch.inputs.copy(), batch.targets.copy()), False

    def synchronize(self):
        intact = np.array_equal(self.batch.inputs, self.expected[0]) and np.array_equal(
            self.batch.targets, self.expected[1]
        )
        assert intact, "the batcher cut into a buffer before the copy from it was done"
        self.done = True


def test_guarded_buffers_are_cut_into_only_after_their_guard(volumes):
    # lookahead 2 and hold 1 (the torch loader's): a ring of 4 buffers, each reused every 4 batches.
    plan = _plan(num_samples=32, batch_size=8)
    batcher = CropBatcher(volumes, plan, AUG, rotate_here=True, threads=2, lookahead=2, hold=1)
    guards = []
    for epoch in range(3):
        for b in range(plan.num_batches):
            batch = batcher.get(epoch, b)
            assert batch.draws == plan.batch_draws(epoch, b)
            guards.append(CopyInFlight(batch))
            batcher.guard(batch, guards[-1])
    ring = 2 + 1 + 1
    # Every buffer that came round again waited for its guard first; the last ring's worth may still be held.
    assert all(g.done for g in guards[:-ring]) and len(guards) == 12
    batcher.close()


def test_draws_are_deterministic_and_differ_by_rank_and_epoch():
    def draws(seed, epoch):
        return [train_draw(seed, epoch, i, box_size=128, crop_size=32, rotate=True) for i in range(64)]

    assert draws(10, 0) == draws(10, 0)
    assert draws(10, 0) != draws(11, 0)  # rank 1's seed is base seed + 1
    assert draws(10, 0) != draws(10, 1)
    corners = np.array([d.corner for d in draws(10, 0) + draws(10, 1)])
    assert corners.min() >= 0 and corners.max() <= 128 - 32
    assert len({d.rotation for d in draws(10, 0) + draws(10, 1) + draws(10, 2)}) == len(ROTATIONS)
    assert {d.rotation for d in (train_draw(10, 0, i, box_size=64, crop_size=32, rotate=False) for i in range(32))} == {
        0
    }
    # Validation crops are one fixed set, whatever the rank; a rank's plan takes its own slice of it.
    plan = DrawPlan(
        seed=0, num_samples=4, batch_size=4, box_size=64, crop_size=32, rotate=False, validation=True, first_index=4
    )
    assert plan.batch_draws(0, 0) == plan.batch_draws(3, 0) == [val_draw(0, i, 64, crop_size=32) for i in range(4, 8)]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda f: f.__delitem__("Hydro"), "no dataset 'Hydro'"),
        (
            lambda f: (f.__delitem__("Nbody"), f.create_dataset("Nbody", data=np.zeros((3, 8, 8, 8), np.float32))),
            "has 3 channels",
        ),
        (
            lambda f: (f.__delitem__("Nbody"), f.create_dataset("Nbody", data=np.zeros((4, 8, 8, 4), np.float32))),
            "expected \\(channels, L, L, L\\)",
        ),
        (
            lambda f: (f.__delitem__("Nbody"), f.create_dataset("Nbody", data=np.zeros((4, 32, 32, 32), np.int16))),
            "expected floating point",
        ),
        (
            lambda f: (f.__delitem__("Nbody"), f.create_dataset("Nbody", data=np.zeros((4, 16, 16, 16), np.float32))),
            "cover different boxes",
        ),
    ],
)
def test_bad_hdf5_files_are_named(tmp_path, tiny_data, mutate, message):
    import shutil

    path = tmp_path / "bad.h5"
    shutil.copy(tiny_data["val"], path)
    with h5py.File(path, "a") as f:
        mutate(f)
    with pytest.raises(DataError, match=message) as err:
        VolumePair.open(VolumeFiles.hdf5(path), 4, 5, crop_size=CROP)
    assert str(path) in str(err.value)


def test_bad_npy_files_are_named(tmp_path, volumes):
    files = _npy_files(tmp_path, volumes, "DHWC")
    with pytest.raises(
        DataError, match="shape \\(32, 32, 32, 4\\), expected \\(channels, L, L, L\\) as npy_layout CDHW"
    ):
        VolumePair.open(VolumeFiles.npy(files.inputs, files.targets, "CDHW"), 4, 5, crop_size=CROP)
    with pytest.raises(DataError, match="label_DHWC.npy: the target array has 5 channels, the model expects 4"):
        VolumePair.open(VolumeFiles.npy(files.targets, files.targets, "DHWC"), 5, 4, crop_size=CROP)
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes(files.inputs.read_bytes()[:1000])
    with pytest.raises(DataError, match="truncated.npy: not a readable .npy file"):
        VolumePair.open(VolumeFiles.npy(truncated, files.targets, "DHWC"), 4, 5, crop_size=CROP)


def test_missing_corrupt_and_too_small(tmp_path, tiny_data):
    with pytest.raises(DataError, match="no such data file"):
        VolumePair.open(VolumeFiles.hdf5(tmp_path / "nope.h5"), 4, 5, crop_size=CROP)
    with pytest.raises(DataError, match="a directory, not a data file"):
        VolumePair.open(VolumeFiles.hdf5(tmp_path), 4, 5, crop_size=CROP)
    (tmp_path / "junk.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        VolumePair.open(VolumeFiles.hdf5(tmp_path / "junk.h5"), 4, 5, crop_size=CROP)
    with pytest.raises(DataError, match="larger than the box"):
        VolumePair.open(VolumeFiles.hdf5(tiny_data["val"]), 4, 5, crop_size=64)


@pytest.mark.parametrize("layout", ["CDHW", "DHWC", "bricks"])
def test_convert_writes_npy_the_npy_format_reads(tmp_path, tiny_data, volumes, layout, monkeypatch):
    import pipeline.convert
    from pipeline.convert import convert

    data, label = convert(tiny_data["train"], tmp_path / "train", layout)
    assert (data.name, label.name) == ("train_data.npy", "train_label.npy")
    converted = VolumePair.open(VolumeFiles.npy(data, label, layout), 4, 5, crop_size=CROP)
    assert np.array_equal(converted.nbody, volumes.nbody) and np.array_equal(converted.hydro, volumes.hydro)
    stamps = [data.stat().st_mtime_ns, label.stat().st_mtime_ns]
    with pytest.raises(DataError, match="train_data.npy and .*train_label.npy exist: --overwrite replaces them"):
        convert(tiny_data["val"], tmp_path / "train", layout)
    assert [data.stat().st_mtime_ns, label.stat().st_mtime_ns] == stamps
    # Interrupted while writing the targets (a full disk, say): the old pair stays whole, no partial file stays.
    real, calls = np.lib.format.open_memmap, []

    def fail_on_the_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline.convert.np.lib.format, "open_memmap", fail_on_the_second)
    with pytest.raises(OSError, match="No space left"):
        convert(tiny_data["val"], tmp_path / "train", layout, overwrite=True)
    monkeypatch.undo()
    assert [data.stat().st_mtime_ns, label.stat().st_mtime_ns] == stamps
    convert(tiny_data["val"], tmp_path / "train", layout, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARK, "train_data.npy", "train_label.npy"]  # no partials
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        convert(data, tmp_path / "other", layout)  # an .npy file is not the HDF5 the converter reads


def test_host_memory_that_cannot_fit_is_refused_before_loading(volumes, monkeypatch):
    """Host storage counts one copy of the volumes per node and each rank's batch buffers; lazy storage the buffers."""
    import pipeline.storage as storage

    host, lazy, buffers = STORAGES["host"], STORAGES["lazy"], 1000
    monkeypatch.setattr(storage, "available_host_bytes", lambda: volumes.nbytes + 3 * buffers)
    check = dict(local_ranks=3, device_dtype="float32")
    storage.check_memory([volumes], host, buffer_bytes=buffers, **check)  # fits: one copy for the 3 ranks
    with pytest.raises(DataError, match="storage 'host' needs .* of host memory on this node .*one copy per node"):
        storage.check_memory([volumes], host, buffer_bytes=buffers + 1, **check)
    storage.check_memory([volumes], lazy, buffer_bytes=volumes.nbytes // 3 + buffers, **check)
    with pytest.raises(DataError, match=r"storage 'lazy' needs .* batch buffers per rank\) .*: lower data_prefetch"):
        storage.check_memory([volumes], lazy, buffer_bytes=volumes.nbytes // 3 + buffers + 1, **check)


@pytest.mark.parametrize("backend, storage", [("torch", "host"), ("torch", "lazy"), ("dali", "lazy")])
def test_the_memory_check_counts_the_batch_buffers_the_batchers_allocate(volumes, backend, storage):
    from pipeline.loaders import batch_buffer_bytes

    settings = LoaderSettings(backend=backend, storage=storage, device_storage_dtype="float32", threads=1, lookahead=3)
    loaders = [
        build_loader(volumes, _plan(), AUG, settings=settings, device=CPU, dtype=torch.float32)
        for _ in ("train", "val")
    ]
    try:
        expected = batch_buffer_bytes(settings, batch=8, crop=CROP, channels=9)
        assert sum(loader.batcher.nbytes for loader in loaders) == expected > 0
    finally:
        for loader in loaders:
            loader.close()


def test_hdf5_inputs_are_read_without_file_locking(tmp_path, tiny_data):
    """A process that holds the file with HDF5's lock (a writer) does not stop the readers."""
    import subprocess
    import sys

    path = tmp_path / "held.h5"
    path.write_bytes(tiny_data["train"].read_bytes())
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import h5py, sys, time; f = h5py.File(sys.argv[1], 'a'); print('open', flush=True); time.sleep(60)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "open\n"
        with pytest.raises(OSError, match="lock"):
            h5py.File(path, "r")  # HDF5's default: refused while the writer holds its lock
        volumes = VolumePair.open(VolumeFiles.hdf5(path), 4, 5, crop_size=CROP)
        assert volumes.box_size == 32 and float(np.asarray(volumes.nbody[0, 0, 0, 0])) == float(
            np.asarray(h5py.File(tiny_data["train"], "r", locking=False)["Nbody"][0, 0, 0, 0])
        )
    finally:
        holder.kill()
        holder.wait()


def test_convert_writes_several_files_into_a_directory_as_bricks_by_default(tmp_path, tiny_data, capsys):
    from pipeline.convert import main as convert_main

    convert_main([str(tiny_data["train"]), str(tiny_data["val"]), "--out_dir", str(tmp_path), "--brick", "16"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        MARK,
        "train_data.npy",
        "train_label.npy",
        "val_data.npy",
        "val_label.npy",
    ]
    assert np.load(tmp_path / "val_label.npy", mmap_mode="r").shape == (2, 2, 2, 5, 16, 16, 16)
    assert "train with: --data_format npy --npy_layout bricks" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one prefix cannot name two files' outputs
        convert_main([str(tiny_data["train"]), str(tiny_data["val"]), "--out_prefix", str(tmp_path / "x")])
