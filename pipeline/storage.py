"""The storage modes, one object each: where the volumes are kept, the memory that takes, the mode a device without
a GPU falls back to, who cuts the crops, and which DALI crop source reads them. docs/data.md has the table.

Adding a mode is a subclass here, its entry in STORAGES, and its tests (CONTRIBUTING.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from common.files import size_text
from pipeline.backends import TORCH
from pipeline.crops import CropBatcher
from pipeline.shared import Node, shared_array
from pipeline.volumes import DataError, VolumePair

log = logging.getLogger(__name__)


def available_host_bytes() -> int | None:
    """MemAvailable of this machine, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True, kw_only=True)
class Kept:
    """The volumes as a mode keeps them: what the batcher or DALI reads, and their copies on the training device."""

    volumes: VolumePair
    resident: tuple[torch.Tensor, torch.Tensor] | None = None


def _read_into(volume: Any, out: np.ndarray) -> None:
    """Copy a (C, L, L, L) volume into ``out`` straight from its file: each channel of an HDF5 dataset in one read,
    a .npy file in slabs of planes that follow its own order on disk."""
    import h5py

    if isinstance(volume, h5py.Dataset) and volume.dtype == np.float32:
        for c in range(volume.shape[0]):
            volume.read_direct(out, np.s_[c], np.s_[c])
        return
    step = max(1, 2**26 // max(1, volume.shape[0] * volume.shape[2] * volume.shape[3]))  # about 256 MiB a slab
    for x in range(0, volume.shape[1], step):
        out[:, x : x + step] = volume[:, x : x + step]


def shared_copy(volumes: VolumePair, node: Node, split: str) -> VolumePair:
    """The volumes in shared memory, one copy per node, read once by its first rank straight into it."""
    arrays = [
        shared_array(node, f"{split}-{name}", shape=tuple(volume.shape), fill=lambda out, v=volume: _read_into(v, out))
        for name, volume in (("nbody", volumes.nbody), ("hydro", volumes.hydro))
    ]
    return VolumePair(files=volumes.files, nbody=arrays[0], hydro=arrays[1])


class StorageMode:
    """What every mode says of itself; the defaults are lazy storage's."""

    name: ClassVar[str]
    on_device: ClassVar[bool] = False  # the volumes resident on the training device, cut there
    loaded: ClassVar[bool] = False  # the volumes read into host memory, one copy per node

    def for_device(self, device_type: str) -> StorageMode:
        """The mode this device can keep: itself, or what it falls back to (saying so)."""
        return self

    def uses_batcher(self, backend: str, reader: str) -> bool:
        """Whether the ``CropBatcher`` cuts the crops on its CPU threads (``reader``: ``VolumeFiles.reader``)."""
        return backend == TORCH or reader != "npy"  # DALI reads plain .npy files itself, neither HDF5 nor bricks

    def host_bytes(self, volume_bytes: int, *, buffer_bytes: int, local_ranks: int) -> int:
        """Host memory on this node: the shared copy of the volumes where there is one, each rank's batch buffers."""
        return (volume_bytes if self.loaded else 0) + buffer_bytes * local_ranks

    def keep(self, volumes: VolumePair, *, node: Node, split: str, device: torch.device, dtype: str) -> Kept:
        return Kept(volumes=volumes)

    def dali_crops(self, kept: Kept, *, batcher: CropBatcher | None, batch_size: int, threads: int, **resident: Any):
        from pipeline import dali

        return dali.BatcherCrops(batcher) if batcher is not None else dali.NumpyCrops(kept.volumes, batch_size, threads)

    def describe(self, volume_bytes: int, *, buffer_bytes: int) -> str:
        return f"volumes on disk ({size_text(volume_bytes)}), {size_text(buffer_bytes)} of batch buffers per rank"

    def __repr__(self) -> str:
        return self.name


class Lazy(StorageMode):
    """Each crop read from the files (the reference's lowmem)."""

    name = "lazy"


class Host(StorageMode):
    """The volumes loaded into host memory once per node, in shared memory that the node's ranks map (inmem)."""

    name = "host"
    loaded = True

    def uses_batcher(self, backend: str, reader: str) -> bool:
        return backend == TORCH  # DALI slices volumes in memory itself

    def keep(self, volumes: VolumePair, *, node: Node, split: str, device: torch.device, dtype: str) -> Kept:
        return Kept(volumes=shared_copy(volumes, node, split))

    def dali_crops(self, kept: Kept, *, batcher: CropBatcher | None, batch_size: int, threads: int, **resident: Any):
        from pipeline import dali

        return dali.BatcherCrops(batcher) if batcher is not None else dali.HostCrops(kept.volumes, threads)

    def describe(self, volume_bytes: int, *, buffer_bytes: int) -> str:
        return (
            f"{size_text(volume_bytes)} of volumes, one copy per node, and {size_text(buffer_bytes)} of batch "
            "buffers per rank"
        )


class Device(StorageMode):
    """The volumes resident in GPU memory, cut there; read from the files once per node, through shared memory."""

    name = "device"
    on_device = True

    def for_device(self, device_type: str) -> StorageMode:
        if device_type == "cuda":
            return self
        log.warning("storage 'device' needs a GPU; keeping the volumes in host memory instead (storage 'host')")
        return HOST

    def uses_batcher(self, backend: str, reader: str) -> bool:
        return False

    def host_bytes(self, volume_bytes: int, *, buffer_bytes: int, local_ranks: int) -> int:
        return volume_bytes  # the shared copy, while the ranks upload it

    def keep(self, volumes: VolumePair, *, node: Node, split: str, device: torch.device, dtype: str) -> Kept:
        resident = to_device(shared_copy(volumes, node, split), device, dtype)  # the shared copy goes with its maps
        return Kept(volumes=volumes, resident=resident)

    def dali_crops(self, kept: Kept, *, batcher: CropBatcher | None, batch_size: int, threads: int, **resident: Any):
        from pipeline import dali

        return dali.ResidentCrops(*kept.resident, **resident)

    def describe(self, volume_bytes: int, *, buffer_bytes: int) -> str:
        return f"{size_text(volume_bytes)} of volumes on each GPU, read through one copy in host memory per node"


LAZY, HOST, DEVICE = Lazy(), Host(), Device()
# By name, in the order of the memory they keep, least first: ranks that choose differently take the first any chose.
STORAGES: dict[str, StorageMode] = {mode.name: mode for mode in (LAZY, HOST, DEVICE)}
AUTO = "auto"  # choose_storage's choice, by what fits


def planned(name: str) -> StorageMode:
    """The mode a config's ``storage`` stands for before a run chooses: its own, or for ``auto`` host (what auto
    keeps where nothing is known of the memory; the benchmarks plan with it)."""
    return STORAGES.get(name, HOST)


KEPT_FREE = 0.1  # the share of a memory storage auto leaves free: allocators' slack, what the estimates miss


def choose_storage(
    *,
    volume_bytes: int,
    on_gpu: int | None,
    gpu_free: int | None,
    training: int,
    host_available: int | None,
    buffer_bytes: int,
    local_ranks: int,
) -> tuple[StorageMode, str]:
    """``storage: auto``: device where the volumes (``on_gpu`` bytes there) and the training fit a GPU's free memory
    with KEPT_FREE to spare, else host where one copy per node and the ranks' buffers fit its memory so, else lazy;
    with the reason, in words."""
    spare = 1 - KEPT_FREE
    gpu = ""
    if gpu_free is not None and on_gpu is not None:
        need = on_gpu + training
        figures = f"the volumes ({size_text(on_gpu)}) and the training (about {size_text(training)})"
        if need <= spare * gpu_free:
            return DEVICE, f"{figures} fit in the GPU's {size_text(gpu_free)} free"
        gpu = f"{figures} need {size_text(need)} of the GPU's {size_text(gpu_free)} free; "
    host = HOST.host_bytes(volume_bytes, buffer_bytes=buffer_bytes, local_ranks=local_ranks)
    node = f"one copy per node and the batch buffers ({size_text(host)})"
    if host_available is None or host <= spare * host_available:
        available = "?" if host_available is None else size_text(host_available)
        return HOST, f"{gpu}{node} fit in the {available} of host memory available"
    return LAZY, f"{gpu}{node} need more than the {size_text(host_available)} of host memory available"


def mode_of(storage: StorageMode | str) -> StorageMode:
    """The mode itself, or the mode of that name."""
    return STORAGES[storage] if isinstance(storage, str) else storage


def device_bytes(volumes: list[VolumePair], dtype: str) -> int:
    """GPU memory of resident volumes: the inputs in ``dtype``, the targets in float32 (the loss's precision)."""
    inputs = sum(int(np.prod(v.nbody.shape)) for v in volumes)
    targets = sum(int(np.prod(v.hydro.shape)) for v in volumes)
    return inputs * (2 if dtype == "float16" else 4) + targets * 4


def to_device(volumes: VolumePair, device: torch.device, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both volumes as contiguous tensors on ``device``, copied one channel at a time (host memory stays at one
    channel of the box): the inputs in ``dtype``, the targets in float32, the loss's precision."""
    resident = []
    for volume, volume_dtype in ((volumes.nbody, getattr(torch, dtype)), (volumes.hydro, torch.float32)):
        out = torch.empty(tuple(volume.shape), dtype=volume_dtype, device=device)
        for c in range(volume.shape[0]):
            out[c].copy_(torch.from_numpy(np.array(volume[c], dtype=np.float32)))  # a copy: shared arrays are read-only
        resident.append(out)
    return resident[0], resident[1]


def check_memory(
    volumes: list[VolumePair], mode: StorageMode, *, buffer_bytes: int, local_ranks: int, device_dtype: str
) -> None:
    """Log what the storage mode needs, and refuse before loading anything when it cannot fit."""
    volume_bytes = sum(v.nbytes for v in volumes)
    need = mode.host_bytes(volume_bytes, buffer_bytes=buffer_bytes, local_ranks=local_ranks)
    available = available_host_bytes()
    log.info(
        "storage '%s': %s; %s of host memory for %d rank(s) on this node (%s available)",
        mode,
        mode.describe(volume_bytes, buffer_bytes=buffer_bytes),
        size_text(need),
        local_ranks,
        "?" if available is None else size_text(available),
    )
    if available is not None and need > available:
        instead = "use storage 'lazy' (or 'device' on a GPU), or " if mode is HOST else ""
        raise DataError(
            f"storage '{mode}' needs {size_text(need)} of host memory on this node ({local_ranks} rank(s): "
            f"{mode.describe(volume_bytes, buffer_bytes=buffer_bytes)}) but {size_text(available)} is available: "
            f"{instead}lower data_prefetch or the micro-batch"
        )
    if not mode.on_device:
        return
    need = device_bytes(volumes, device_dtype)
    free, total = torch.cuda.mem_get_info()
    log.info(
        "storage 'device': %s of volumes on each GPU, %s of %s free", size_text(need), size_text(free), size_text(total)
    )
    if need > free:
        raise DataError(
            f"storage 'device' needs {size_text(need)} of GPU memory but {size_text(free)} is free: "
            "set device_storage_dtype: float16, or use storage 'host'"
        )
