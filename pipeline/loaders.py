"""Storage modes and backends put together: the loaders a training run iterates over.

``lazy`` reads each crop from the files, ``host`` loads the volumes into this process's memory, ``device`` into GPU
memory. The DALI backend cuts and rotates inside its graph (``pipeline.dali``), the torch backend on the batcher's
threads or, for ``device``, with ``pipeline.device_cut.DeviceCutter`` (``pipeline.torch_backend``); either way the
rotation happens on the training device.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pipeline.crops import CropBatcher, ring_slots
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.volumes import DataError, VolumePair

log = logging.getLogger(__name__)

Storage = Literal["lazy", "host", "device"]
Backend = Literal["dali", "torch"]
Auto = Literal["auto"]

_GIB = 2**30


def dali_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # not even the nvidia namespace
        return False


def _size(nbytes: float) -> str:
    return f"{nbytes / _GIB:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True, kw_only=True)
class LoaderSettings:
    backend: Backend
    storage: Storage
    device_storage_dtype: Literal["float32", "float16"]
    threads: int
    lookahead: int
    channels_last: bool = False


def effective_storage(storage: Storage, device_type: str) -> Storage:
    """``device`` needs a GPU; elsewhere it falls back to ``host``, and says so."""
    if storage == "device" and device_type != "cuda":
        log.warning("storage 'device' needs a GPU; keeping the volumes in host memory instead (storage 'host')")
        return "host"
    return storage


def resolve_backend(backend: Backend | Auto, device_type: str, storage: Storage) -> Backend:
    """``auto`` is torch on a CPU, where the batcher's single fused copy is faster than DALI's CPU operators, and for
    volumes resident on a GPU, where both backends cut with the same ``DeviceCutter`` and DALI adds two copies; DALI
    for the GPU's other storage modes, where it reads and cuts on its own threads. The measurements: docs/data.md."""
    if backend != "auto":
        return backend
    return "dali" if device_type == "cuda" and storage != "device" else "torch"


def uses_batcher(backend: Backend, storage: Storage, data_format: str) -> bool:
    """Whether the Python ``CropBatcher`` cuts the crops: always on the torch backend's host paths; on DALI's only
    for HDF5 files read lazily (DALI reads .npy files and slices volumes in memory itself, but has no HDF5 reader)."""
    if backend == "torch":
        return storage != "device"
    return storage == "lazy" and data_format == "hdf5"


def batches_held(backend: Backend) -> int:
    """Batches a loader may still read after the batcher returned them: DALI may hold the one it is processing
    and the one it prefetched; the torch loader copies at once."""
    return 2 if backend == "dali" else 1


def batch_buffer_bytes(
    settings: LoaderSettings, batch: int, crop: int, *, channels: int, data_format: str = "hdf5"
) -> int:
    """Host memory of one rank's batch buffers, for the training and the validation loader (``channels``: input
    plus target): the batchers' rings, or DALI's own buffers (its prefetched batches, about one batch per stage of
    the graph); none where the volumes are cut on the device."""
    storage = settings.storage
    if storage == "device":
        return 0
    if uses_batcher(settings.backend, storage, data_format):
        slots = ring_slots(settings.lookahead, batches_held(settings.backend))
    else:
        slots = settings.lookahead + 3  # prefetched batches, the slice and the rotation's passes
    return 2 * slots * batch * channels * crop**3 * 4


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(volumes: list[VolumePair], settings: LoaderSettings, local_ranks: int, *, buffer_bytes: int) -> None:
    """Log what the storage mode needs, and refuse before loading anything when it cannot fit.

    Host memory per rank: the volumes under ``host``, and the batchers' rings (``buffer_bytes``, from
    ``batch_buffer_bytes``) under ``host`` and ``lazy``; times the ranks on this node.
    """
    storage = settings.storage
    volume_bytes = sum(v.nbytes for v in volumes)
    if storage in ("lazy", "host"):
        resident = volume_bytes if storage == "host" else 0
        need, available = (resident + buffer_bytes) * local_ranks, _available_host_bytes()
        size = _size(volume_bytes)
        volumes_note = f"{size} of volumes and" if resident else f"volumes on disk ({size}),"
        log.info(
            "storage '%s': %s %s of batch buffers per rank, %s for %d rank(s) on this node (%s available)",
            storage,
            volumes_note,
            _size(buffer_bytes),
            _size(need),
            local_ranks,
            "?" if available is None else _size(available),
        )
        if available is not None and need > available:
            instead = "use storage 'lazy' (or 'device' on a GPU), or " if storage == "host" else ""
            each = f"{_size(resident)} of volumes and " if resident else ""
            raise DataError(
                f"storage '{storage}' needs {_size(need)} of host memory on this node ({local_ranks} rank(s), each "
                f"{each}{_size(buffer_bytes)} of batch buffers) but {_size(available)} is available: "
                f"{instead}lower data_prefetch or the micro-batch"
            )
        return
    # Only the inputs take device_storage_dtype; the targets stay float32, the precision of the loss.
    input_bytes = sum(4 * int(np.prod(v.nbody.shape)) for v in volumes)
    need = volume_bytes - (input_bytes // 2 if settings.device_storage_dtype == "float16" else 0)
    free, total = torch.cuda.mem_get_info()
    log.info(
        "storage 'device': %s of volumes (inputs in %s, targets in float32) on each GPU, %s of %s free",
        _size(need),
        settings.device_storage_dtype,
        _size(free),
        _size(total),
    )
    if need > free:
        raise DataError(
            f"storage 'device' needs {_size(need)} of GPU memory but {_size(free)} is free: "
            "set device_storage_dtype: float16, or use storage 'host'"
        )


def to_device(volumes: VolumePair, device: torch.device, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both volumes as contiguous tensors on ``device``, copied one channel at a time (host memory stays at one
    channel of the box): the inputs in ``dtype``, the targets in float32, the loss's precision."""
    resident = []
    for volume, volume_dtype in ((volumes.nbody, getattr(torch, dtype)), (volumes.hydro, torch.float32)):
        out = torch.empty(tuple(volume.shape), dtype=volume_dtype, device=device)
        for c in range(volume.shape[0]):
            out[c].copy_(torch.from_numpy(np.array(volume[c], dtype=np.float32)))  # a copy: memory maps are read-only
        resident.append(out)
    return resident[0], resident[1]


def build_loader(
    volumes: VolumePair,
    plan: DrawPlan,
    augmenter: Augmenter,
    *,
    settings: LoaderSettings,
    device: torch.device,
    dtype: torch.dtype,
    first_epoch: int = 0,
    first_batch: int = 0,
):
    """A DaliLoader or TorchLoader for ``plan`` over ``volumes``, kept as ``settings.storage`` says, which must
    already be what this device can do (see ``effective_storage``)."""
    storage = settings.storage
    on_gpu = device.type == "cuda"
    common = dict(
        plan=plan,
        augmenter=augmenter,
        dtype=dtype,
        first_epoch=first_epoch,
        first_batch=first_batch,
        channels_last=settings.channels_last,
    )
    resident = to_device(volumes, device, settings.device_storage_dtype) if storage == "device" else None
    source = volumes.load() if storage == "host" else volumes
    batcher = None
    if uses_batcher(settings.backend, storage, volumes.files.format):
        from pipeline.torch_backend import pinned_buffer

        # Cut straight into NDHWC buffers for channels-last batches, where the CPU does the rotation; where the
        # device rotates, it also moves the channels. The torch backend uploads straight from the batcher's
        # buffers, pinned on a GPU; DALI stages its own.
        channels_last = settings.channels_last and not on_gpu
        allocate = {"allocate": pinned_buffer} if on_gpu and settings.backend == "torch" else {}
        hold = batches_held(settings.backend)
        batcher = CropBatcher(
            source,
            plan,
            augmenter,
            rotate_here=not on_gpu,
            threads=settings.threads,
            lookahead=settings.lookahead,
            hold=hold,
            channels_last=channels_last,
            **allocate,
        )
    if settings.backend == "torch":
        from pipeline.torch_backend import TorchLoader

        rotate = on_gpu or resident is not None  # resident volumes are cut (and rotated) by the gather
        return TorchLoader(device=device, batcher=batcher, resident=resident, rotate_on_device=rotate, **common)
    from pipeline import dali  # imported here: machines without DALI use the torch backend

    if batcher is not None:
        crops = dali.BatcherCrops(batcher)
    elif resident is not None:
        crops = dali.ResidentCrops(
            *resident, augmenter, crop_size=plan.crop_size, dtype=dtype, channels_last=settings.channels_last
        )
    elif storage == "host":
        crops = dali.HostCrops(source, settings.threads)
    else:
        crops = dali.NumpyCrops(volumes, plan.batch_size, settings.threads)
    return dali.DaliLoader(
        crops=crops, device_id=device.index if on_gpu else None, prefetch=settings.lookahead, **common
    )
