"""Storage modes and backends put together: the loaders a training run iterates over.

The storage mode (``pipeline.storage``) keeps the volumes; the DALI backend cuts and rotates inside its graph
(``pipeline.dali``), the torch backend on the batcher's threads or, for volumes on the device, with
``pipeline.device_cut.DeviceCutter`` (``pipeline.torch_backend``); either way the rotation happens on the training
device.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Literal

import torch

from pipeline.backends import AUTO, DALI, TORCH, Backend
from pipeline.crops import CropBatcher, ring_slots
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.shared import Node
from pipeline.storage import StorageMode, mode_of
from pipeline.volumes import VolumePair

log = logging.getLogger(__name__)


def dali_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # not even the nvidia namespace
        return False


@dataclass(frozen=True, kw_only=True)
class LoaderSettings:
    backend: Backend
    storage: StorageMode  # or its name
    device_storage_dtype: Literal["float32", "float16"]
    threads: int
    lookahead: int
    channels_last: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage", mode_of(self.storage))


def resolve_backend(backend: str, device_type: str, storage: StorageMode | str) -> Backend:
    """``auto`` is torch on a CPU, where the batcher's single fused copy is faster than DALI's CPU operators, and for
    volumes resident on a GPU, where both backends cut with the same ``DeviceCutter`` and DALI adds two copies; DALI
    for the GPU's other storage modes, where it reads and cuts on its own threads. The measurements: docs/data.md."""
    if backend != AUTO:
        return backend
    return DALI if device_type == "cuda" and not mode_of(storage).on_device else TORCH


def batches_held(backend: Backend) -> int:
    """Batches a loader may still read after the batcher returned them: DALI may hold the one it is processing
    and the one it prefetched; the torch loader copies at once."""
    return 2 if backend == DALI else 1


def batch_buffer_bytes(settings: LoaderSettings, batch: int, crop: int, *, channels: int, reader: str = "hdf5") -> int:
    """Host memory of one rank's batch buffers, for the training and the validation loader (``channels``: input
    plus target): the batchers' rings, or DALI's own buffers (its prefetched batches, about one batch per stage of
    the graph); none where the volumes are cut on the device."""
    storage = settings.storage
    if storage.on_device:
        return 0
    if storage.uses_batcher(settings.backend, reader):
        slots = ring_slots(settings.lookahead, batches_held(settings.backend))
    else:
        slots = settings.lookahead + 3  # prefetched batches, the slice and the rotation's passes
    return 2 * slots * batch * channels * crop**3 * 4


def build_loader(
    volumes: VolumePair,
    plan: DrawPlan,
    augmenter: Augmenter,
    *,
    settings: LoaderSettings,
    device: torch.device,
    dtype: torch.dtype,
    node: Node | None = None,
    split: str = "train",
    first_epoch: int = 0,
    first_batch: int = 0,
):
    """A DaliLoader or TorchLoader for ``plan`` over ``volumes``, kept as ``settings.storage`` keeps them (a mode this
    device can keep: ``StorageMode.for_device``); ``node`` shares a loaded copy among the node's ranks."""
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
    kept = storage.keep(volumes, node=node or Node(), split=split, device=device, dtype=settings.device_storage_dtype)
    batcher = None
    if storage.uses_batcher(settings.backend, volumes.files.reader):
        from pipeline.torch_backend import pinned_buffer

        # Cut straight into NDHWC buffers for channels-last batches, where the CPU does the rotation; where the
        # device rotates, it also moves the channels. The torch backend uploads straight from the batcher's
        # buffers, pinned on a GPU; DALI stages its own.
        channels_last = settings.channels_last and not on_gpu
        allocate = {"allocate": pinned_buffer} if on_gpu and settings.backend == TORCH else {}
        batcher = CropBatcher(
            kept.volumes,
            plan,
            augmenter,
            rotate_here=not on_gpu,
            threads=settings.threads,
            lookahead=settings.lookahead,
            hold=batches_held(settings.backend),
            channels_last=channels_last,
            **allocate,
        )
    if settings.backend == TORCH:
        from pipeline.torch_backend import TorchLoader

        rotate = on_gpu or kept.resident is not None  # resident volumes are cut (and rotated) by the gather
        return TorchLoader(device=device, batcher=batcher, resident=kept.resident, rotate_on_device=rotate, **common)
    from pipeline import dali  # imported here: machines without DALI use the torch backend

    crops = storage.dali_crops(
        kept,
        batcher=batcher,
        batch_size=plan.batch_size,
        threads=settings.threads,
        augmenter=augmenter,
        crop_size=plan.crop_size,
        dtype=dtype,
        channels_last=settings.channels_last,
    )
    return dali.DaliLoader(
        crops=crops, device_id=device.index if on_gpu else None, prefetch=settings.lookahead, **common
    )
