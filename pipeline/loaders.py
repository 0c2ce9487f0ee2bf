"""Storage modes and backends put together: the loaders a training run iterates over.

``lazy`` reads each crop from the files, ``host`` loads the volumes into this process's memory,
``device`` loads them into GPU memory (float16 optionally, to halve the footprint), where one gather
per tensor cuts and rotates each batch (``pipeline.torch_backend.DeviceCutter``, whichever the backend),
with no per-step copy from the host. Rotation happens on the training device: on a GPU by the
backend's ops; on a CPU while the batcher cuts the crop (one fused copy).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pipeline.crops import CropBatcher
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.volumes import DataError, VolumePair

log = logging.getLogger(__name__)

Storage = Literal["lazy", "host", "device"]
Backend = Literal["dali", "torch"]

_GIB = 2**30


def dali_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # not even the nvidia namespace
        return False


def _size(nbytes: float) -> str:
    return f"{nbytes / _GIB:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
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


def crop_backend(backend: Backend, storage: Storage) -> Backend:
    """The backend that really cuts the crops, for an effective ``storage``: volumes resident on the GPU are
    cut by the torch backend's gather whichever the backend (DALI's GPU external source would copy a batch
    that lists the same volume once per sample)."""
    return "torch" if storage == "device" else backend


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(storage: Storage, volumes: list[VolumePair], settings: LoaderSettings, local_ranks: int) -> None:
    """Log what the storage mode needs, and refuse before loading anything when it cannot fit."""
    volume_bytes = sum(v.nbytes for v in volumes)
    if storage == "lazy":
        log.info("storage 'lazy': volumes stay on disk (%s), crops read on demand", _size(volume_bytes))
        return
    if storage == "host":
        need, available = volume_bytes * local_ranks, _available_host_bytes()
        log.info(
            "storage 'host': %s of volumes per rank, %s for %d rank(s) on this node (%s available)",
            _size(volume_bytes), _size(need), local_ranks, "?" if available is None else _size(available),
        )  # fmt: skip
        if available is not None and need > available:
            raise DataError(
                f"storage 'host' needs {_size(need)} of host memory on this node but {_size(available)} "
                "is available: use storage 'lazy' (or 'device' on a GPU)"
            )
        return
    per_element = 2 if settings.device_storage_dtype == "float16" else 4
    need = volume_bytes // 4 * per_element
    free, total = torch.cuda.mem_get_info()
    log.info(
        "storage 'device': %s of volumes (%s) on each GPU, %s of %s free",
        _size(need), settings.device_storage_dtype, _size(free), _size(total),
    )  # fmt: skip
    if need > free:
        raise DataError(
            f"storage 'device' needs {_size(need)} of GPU memory but {_size(free)} is free: "
            "set device_storage_dtype: float16, or use storage 'host'"
        )


def to_device(volumes: VolumePair, device: torch.device, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both volumes as contiguous tensors on ``device``, copied one channel at a time to bound host memory."""
    resident = []
    for volume in (volumes.nbody, volumes.hydro):
        out = torch.empty(tuple(volume.shape), dtype=getattr(torch, dtype), device=device)
        for c in range(volume.shape[0]):
            out[c].copy_(torch.from_numpy(np.ascontiguousarray(volume[c], dtype=np.float32)))
        resident.append(out)
    return resident[0], resident[1]


def build_loader(
    volumes: VolumePair,
    plan: DrawPlan,
    augmenter: Augmenter,
    settings: LoaderSettings,
    storage: Storage,
    device: torch.device,
    dtype: torch.dtype,
    first_epoch: int = 0,
    first_batch: int = 0,
):
    """A DaliLoader or TorchLoader for ``plan`` over ``volumes``, kept as ``storage`` says.

    ``storage`` must already be what this device can do (see ``effective_storage``).
    """
    on_gpu = device.type == "cuda"
    common = dict(
        plan=plan, augmenter=augmenter, dtype=dtype, rotate_on_device=on_gpu, first_epoch=first_epoch,
        first_batch=first_batch, channels_last=settings.channels_last,
    )  # fmt: skip
    from pipeline.torch_backend import TorchLoader, pinned_buffer

    backend = crop_backend(settings.backend, storage)
    if storage == "device":  # one gather per tensor cuts and rotates the batch on the GPU
        return TorchLoader(device=device, resident=to_device(volumes, device, settings.device_storage_dtype), **common)
    source = volumes.load() if storage == "host" else volumes
    # DALI may hold the batch it is processing and the one it prefetched; the torch loader copies at once.
    hold = 2 if backend == "dali" else 1
    # Cut straight into NDHWC buffers for channels-last batches, where the CPU does the rotation; where the
    # device rotates, it also moves the channels.
    channels_last = settings.channels_last and not on_gpu
    # The torch backend uploads straight from the batcher's buffers, pinned on a GPU; DALI stages its own.
    allocate = {"allocate": pinned_buffer} if on_gpu and backend == "torch" else {}
    batcher = CropBatcher(
        source, plan, augmenter, not on_gpu, settings.threads, settings.lookahead, hold, channels_last, **allocate
    )
    if backend == "dali":
        from pipeline.dali import DaliLoader  # imported here: machines without DALI use the torch backend

        return DaliLoader(device_id=device.index if on_gpu else None, batcher=batcher, **common)
    return TorchLoader(device=device, batcher=batcher, **common)
