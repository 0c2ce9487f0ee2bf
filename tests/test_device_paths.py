"""The device paths of both backends against the numpy reference, on every device present.

On a GPU these paths rotate crops with DALI operators or torch ops and cut them from volumes resident
in GPU memory; on the CPU the same code runs on CPU data. CI runs the CPU variants; on a GPU machine
``tools/gpu_check.sh`` runs this file again, CUDA included (DALI where it is installed).
"""

import statistics
import time

import numpy as np
import pytest
import torch

from pipeline.crops import CropBatcher
from pipeline.loaders import LoaderSettings, build_loader, dali_installed
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.storage import to_device
from pipeline.volumes import VolumeFiles, VolumePair
from tests.conftest import EveryRotation

CROP = 8
AUG = Augmenter(in_channels=4, out_channels=5, in_vectors=[[1, 2, 3]], out_vectors=[[1, 2, 3]])
HAVE_DALI = dali_installed()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BACKENDS = ["torch"] + (["dali"] if HAVE_DALI else [])


PLAN = EveryRotation(
    seed=0, num_samples=52, batch_size=8, box_size=32, crop_size=CROP, rotate=True
)  # 6 full + 1 partial


@pytest.fixture(scope="module")
def volumes(tiny_data):
    return VolumePair.open(VolumeFiles.hdf5(tiny_data["train"]), 4, 5, crop_size=CROP).load()


def _loader(backend, device, volumes, source, storage_dtype, dtype, aug=AUG, plan=PLAN):
    """A loader whose device rotates: crops from a (non-rotating) batcher, or cut from resident volumes."""
    common = dict(plan=plan, augmenter=aug, dtype=dtype)
    resident = to_device(volumes, device, storage_dtype) if source == "resident" else None
    if source == "batcher":
        hold = 2 if backend == "dali" else 1
        batcher = CropBatcher(volumes, plan, aug, rotate_here=False, threads=2, lookahead=2, hold=hold)
    if backend == "dali":
        from pipeline.dali import BatcherCrops, DaliLoader, ResidentCrops

        if source == "batcher":
            crops = BatcherCrops(batcher)
        else:
            crops = ResidentCrops(*resident, aug, crop_size=plan.crop_size, dtype=dtype, channels_last=False)
        return DaliLoader(crops=crops, device_id=device.index if device.type == "cuda" else None, **common)
    from pipeline.torch_backend import TorchLoader

    if source == "batcher":
        return TorchLoader(device=device, batcher=batcher, rotate_on_device=True, **common)
    return TorchLoader(device=device, resident=resident, rotate_on_device=True, **common)


CASES = [("batcher", "float32"), ("resident", "float32"), ("resident", "float16")]


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source, storage_dtype", CASES)
def test_device_rotation_equals_reference_for_all_24(volumes, device_type, backend, source, storage_dtype):
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.float16 if device_type == "cuda" else torch.float32
    loader = _loader(backend, device, volumes, source, storage_dtype, dtype)
    half = storage_dtype == "float16"
    for epoch in range(2):
        batches = [(inputs.cpu(), targets.cpu()) for inputs, targets in loader]
        assert len(batches) == PLAN.num_batches == 7 and len(batches[-1][0]) == 4
        for b, (inputs, targets) in enumerate(batches):
            assert inputs.dtype == dtype and targets.dtype == torch.float32
            for j, draw in enumerate(PLAN.batch_draws(epoch, b)):
                ref_inp, ref_tar = AUG.reference(volumes, draw, CROP)
                if half:  # the input volume itself was rounded to float16 (the targets stay float32); rotating is exact
                    ref_inp = ref_inp.astype(np.float16)
                assert torch.equal(inputs[j], torch.from_numpy(ref_inp).to(dtype)), (epoch, b, j, draw)
                assert torch.equal(targets[j], torch.from_numpy(ref_tar)), (epoch, b, j, draw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_general_vector_layouts(volumes, backend):
    # Five input channels (the fifth scalar) and targets whose vector components are stored out of order.
    aug = Augmenter(in_channels=5, out_channels=5, in_vectors=[[1, 2, 3]], out_vectors=[[3, 1, 2]])
    vols = VolumePair(volumes.files, np.concatenate([volumes.nbody, volumes.hydro[4:]]), volumes.hydro)
    plan = EveryRotation(seed=0, num_samples=24, batch_size=24, box_size=32, crop_size=CROP, rotate=True)
    device = torch.device(DEVICES[-1], 0) if DEVICES[-1] == "cuda" else torch.device("cpu")
    loader = _loader(backend, device, vols, "batcher", "float32", torch.float32, aug=aug, plan=plan)
    ((inputs, targets),) = [(i.cpu(), t.cpu()) for i, t in loader]
    for j, draw in enumerate(plan.batch_draws(0, 0)):
        ref_inp, ref_tar = aug.reference(vols, draw, CROP)
        assert np.array_equal(inputs[j].numpy(), ref_inp) and np.array_equal(targets[j].numpy(), ref_tar)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("storage", ["lazy", "host", "device"])
def test_gpu_storage_modes_give_the_same_samples(volumes, tiny_data, backend, storage):
    plan = DrawPlan(seed=0, num_samples=20, batch_size=8, box_size=32, crop_size=CROP, rotate=True)
    opened = VolumePair.open(VolumeFiles.hdf5(tiny_data["train"]), 4, 5, crop_size=CROP)
    settings = LoaderSettings(backend=backend, storage=storage, device_storage_dtype="float32", threads=2, lookahead=2)
    loader = build_loader(opened, plan, AUG, settings=settings, device=torch.device("cuda", 0), dtype=torch.float32)
    for b, (inputs, targets) in enumerate(loader):
        assert inputs.device.type == "cuda"
        for j, draw in enumerate(plan.batch_draws(0, b)):
            ref_inp, ref_tar = AUG.reference(volumes, draw, CROP)
            assert np.array_equal(inputs[j].cpu().numpy(), ref_inp) and np.array_equal(
                targets[j].cpu().numpy(), ref_tar
            )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("storage", ["host", "device"])
def test_gpu_batches_of_the_torch_backend_need_no_host_sync(tiny_data, storage):
    """Pinned staging and the batched gather: a batch is queued on the GPU without waiting for it."""
    plan = DrawPlan(seed=0, num_samples=24, batch_size=8, box_size=32, crop_size=CROP, rotate=True)
    opened = VolumePair.open(VolumeFiles.hdf5(tiny_data["train"]), 4, 5, crop_size=CROP)
    settings = LoaderSettings(
        backend="torch", storage=storage, device_storage_dtype="float32", threads=2, lookahead=2, channels_last=True
    )
    batches = iter(
        build_loader(opened, plan, AUG, settings=settings, device=torch.device("cuda", 0), dtype=torch.float16)
    )
    next(batches)  # the first batch sets things up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rest = list(batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(rest) == 2 and all(inputs.is_contiguous(memory_format=torch.channels_last_3d) for inputs, _ in rest)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("storage", ["lazy", "host"])
def test_batches_held_on_the_gpu_keep_their_samples(volumes, tiny_data, storage):
    """The batcher's pinned buffers go up asynchronously and come round again every 4 batches: with the copies
    held back on the GPU (a sleep queued first on the copy stream), each buffer is cut into again only after
    its copy, so 10 batches kept on the GPU without a host sync still hold their own samples."""
    plan = DrawPlan(seed=0, num_samples=80, batch_size=8, box_size=32, crop_size=CROP, rotate=True)
    opened = VolumePair.open(VolumeFiles.hdf5(tiny_data["train"]), 4, 5, crop_size=CROP)
    settings = LoaderSettings(backend="torch", storage=storage, device_storage_dtype="float32", threads=2, lookahead=2)
    loader = build_loader(opened, plan, AUG, settings=settings, device=torch.device("cuda", 0), dtype=torch.float32)
    with torch.cuda.stream(loader.copy_stream):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the first copy
    held = list(loader)
    for b, (inputs, targets) in enumerate(held):
        for j, draw in enumerate(plan.batch_draws(0, b)):
            ref_inp, ref_tar = AUG.reference(volumes, draw, CROP)
            assert np.array_equal(inputs[j].cpu().numpy(), ref_inp), (b, j)
            assert np.array_equal(targets[j].cpu().numpy(), ref_tar), (b, j)


def _median_batch_s(loader, batches: int, device: torch.device) -> float:
    """Median wall time of one batch over ``batches`` (after one batch of warm-up), the device synchronized."""
    iterator, times = iter(loader), []
    next(iterator)
    for _ in range(batches):
        start = time.perf_counter()
        inputs, _ = next(iterator)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.skipif(not HAVE_DALI, reason="DALI is not installed here")
@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("storage", ["host", "device"])
def test_dali_cuts_crops_without_copying_the_volume(device_type, storage):
    """The proof that no batch copies the volume: batches of 8^3 crops take as long from a 16^3 box as from a
    160^3 box (148 MB), and on the CPU far less than one copy of that box, which any per-batch copy of the volume
    would add (per sample: DALI's external source given the volume once per sample). Host storage: the volume
    listed per sample, no_copy, sliced on the CPU; device storage: the volume held by the gathering function. On a
    GPU a copy of the box (0.1 ms) is shorter than a batch's fixed cost, so the proof is the memory: DALI receives
    only the gathered crops, and a copy of the volume made per batch by the gather would raise torch's allocation
    peak by the volume's size."""
    if storage == "host" and device_type == "cuda":
        pytest.skip("host volumes are sliced on the CPU whatever the training device: the CPU case is the proof")
    from pipeline.dali import DaliLoader, HostCrops, ResidentCrops

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    rng = np.random.default_rng(0)
    times, allocated_peak = {}, {}
    for box in (16, 160):
        volumes = VolumePair(
            VolumeFiles.hdf5("unused.h5"),
            rng.random((4, box, box, box), np.float32),
            rng.random((5, box, box, box), np.float32),
        )
        plan = DrawPlan(seed=0, num_samples=8 * 21, batch_size=8, box_size=box, crop_size=CROP, rotate=True)
        if storage == "host":
            crops = HostCrops(volumes, threads=2)
        else:
            crops = ResidentCrops(
                *to_device(volumes, device, "float32"), AUG, crop_size=CROP, dtype=torch.float32, channels_last=False
            )
        loader = DaliLoader(plan=plan, augmenter=AUG, crops=crops, device_id=device.index, dtype=torch.float32)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device)
        times[box] = _median_batch_s(loader, 20, device)
        if device.type == "cuda":
            allocated_peak[box] = torch.cuda.max_memory_allocated(device) - resident
        loader.close()
    volume_bytes = 4 * 9 * 160**3
    if device.type == "cuda":
        print(
            f"\nDALI device storage on cuda: a batch of 8 crops takes {1e3 * times[16]:.2f} ms from a 16^3 box, "
            f"{1e3 * times[160]:.2f} ms from a 160^3 box ({volume_bytes / 2**20:.0f} MiB); torch allocated at most "
            f"{allocated_peak[160] / 2**20:.2f} MiB beyond the volumes while cutting them"
        )
        assert allocated_peak[160] < volume_bytes / 8, "the gather allocates as much as the volume"
        assert allocated_peak[160] < 4 * allocated_peak[16] + 2**20, "the gather allocates more from a larger box"
    else:
        held = [torch.as_tensor(v) for v in (volumes.nbody, volumes.hydro)]
        copies = []
        for _ in range(5):
            start = time.perf_counter()
            for v in held:
                v.clone()
            copies.append(time.perf_counter() - start)
        copy_s = statistics.median(copies)
        print(
            f"\nDALI {storage} storage on cpu: a batch of 8 crops takes {1e3 * times[16]:.2f} ms from a 16^3 box, "
            f"{1e3 * times[160]:.2f} ms from a 160^3 box; one copy of the 160^3 box takes {1e3 * copy_s:.2f} ms"
        )
        assert times[160] < copy_s / 2, "a batch takes as long as copying the volume"
    assert times[160] < 3 * times[16] + 0.005, "batches take longer from a larger box"


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCDHW", "NDHWC"])
@pytest.mark.parametrize("source", ["volumes", "crops"])
def test_the_cutter_gives_the_reference_from_volumes_and_from_crops(volumes, channels_last, source):
    """Every sample of the 24 rotations, in both layouts, from resident volumes and from a batch of unrotated
    crops (the torch backend's GPU path for crops the CPU cut)."""
    from pipeline.device_cut import DeviceCutter

    plan = EveryRotation(seed=0, num_samples=24, batch_size=24, box_size=32, crop_size=CROP, rotate=True)
    draws = plan.batch_draws(0, 0)
    cutter = DeviceCutter(AUG, CROP, torch.device("cpu"))
    if source == "volumes":
        sources = to_device(volumes, torch.device("cpu"), "float32")
    else:  # each sample's crop as it lies, then rotated by the cutter
        crops = [
            [v[(slice(None), *(slice(c, c + CROP) for c in d.corner))] for d in draws]
            for v in (volumes.nbody, volumes.hydro)
        ]
        sources = tuple(torch.from_numpy(np.stack(c)) for c in crops)
    args = cutter.arguments(draws, cut_already=source == "crops")
    inputs, targets = cutter(sources, args, (torch.float16, torch.float32), channels_last=channels_last)
    assert inputs.dtype == torch.float16 and inputs.is_contiguous(memory_format=torch.channels_last_3d) == channels_last
    for j, draw in enumerate(draws):
        ref_inp, ref_tar = AUG.reference(volumes, draw, CROP)
        assert torch.equal(inputs[j], torch.from_numpy(ref_inp).half()) and torch.equal(
            targets[j], torch.from_numpy(ref_tar)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_resident_batches_cut_ahead_wait_for_nothing_they_should_not(volumes):
    """Batches of resident volumes are cut on a stream of their own while the training stream is busy (a sleep
    queued on it first): each still holds its own samples."""
    from pipeline.torch_backend import TorchLoader

    device = torch.device("cuda", 0)
    loader = TorchLoader(
        plan=PLAN,
        augmenter=AUG,
        device=device,
        dtype=torch.float32,
        rotate_on_device=True,
        resident=to_device(volumes, device, "float32"),
    )
    torch.cuda.synchronize()
    kept = []
    for inputs, targets in loader:
        torch.cuda._sleep(50_000_000)  # the training stream stays busy while the next batch is cut
        kept.append((inputs * 1, targets * 1))  # read on the training stream, after the sleep
    for b, (inputs, targets) in enumerate(kept):
        for j, draw in enumerate(PLAN.batch_draws(0, b)):
            ref_inp, ref_tar = AUG.reference(volumes, draw, CROP)
            assert np.array_equal(inputs[j].cpu().numpy(), ref_inp) and np.array_equal(
                targets[j].cpu().numpy(), ref_tar
            )
