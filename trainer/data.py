"""The data a run trains on, from its config: ``build_data`` (a ``RunData``: the volumes, opened and checked, the
storage mode ``auto`` chose and the backend, and the loaders that cut them), the synthetic boxes made once per node,
the validation samples each rank takes. Bad data, and data that cannot fit, are found before the engine is built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from model import UNetSpec
from model.memory import training_bytes
from model.metrics import Normalization
from pipeline.backends import DALI
from pipeline.loaders import LoaderSettings, batch_buffer_bytes, build_loader, dali_installed, resolve_backend
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.shared import Node
from pipeline.storage import (
    HOST,
    LAZY,
    STORAGES,
    StorageMode,
    available_host_bytes,
    check_memory,
    choose_storage,
    device_bytes,
)
from pipeline.synthetic import ensure_boxes
from pipeline.volumes import VolumeFiles, VolumePair, target_attributes
from trainer.config import Config, channels_last_on, to_dict
from trainer.config.sections import Sampling
from trainer.dist import Device, DistEnv, on_any_rank
from trainer.engine import engine_config, plan_batches, precision_of
from trainer.errors import ConfigError

log = logging.getLogger(__name__)


def unused_data_keys(cfg: Config, storage: StorageMode, backend: str, *, device_type: str) -> list[str]:
    """Keys set away from their defaults that the effective ``storage`` mode, ``backend`` and device do not use
    (each key's ``unused`` rule, beside its definition in ``trainer.config``)."""
    return [
        f.name
        for f in dataclasses.fields(Config)
        if f.metadata["unused"] is not None
        and f.metadata["unused"](cfg, storage, backend, device_type)
        and getattr(cfg, f.name) != f.default
    ]


def prepare_data(cfg: Config, dist: DistEnv) -> None:
    """Generate the synthetic boxes the config asks for, once per node, before anyone reads them."""
    if cfg.synthetic is not None and dist.local_rank == 0:
        for which, path in ensure_boxes(cfg.synthetic, cfg.train_path, cfg.val_path):
            log.info("generated synthetic %s box %s", which, path)
    torch_dist.barrier()


def volume_files(cfg: Config, split: str) -> VolumeFiles:
    """Where the config says the ``split`` ('train' or 'val') volumes are."""
    if cfg.data_format == "hdf5":
        return VolumeFiles.hdf5(cfg.train_path if split == "train" else cfg.val_path)
    if split == "train":
        return VolumeFiles.npy(cfg.train_path_npy_data, cfg.train_path_npy_label, cfg.npy_layout)
    return VolumeFiles.npy(cfg.val_path_npy_data, cfg.val_path_npy_label, cfg.npy_layout)


def normalization(cfg: Config, split: str) -> Normalization:
    """How the ``split``'s temperature is normalized: ``temperature_log_range`` where the config sets it (a file
    declaring another is warned about), else what the file declares (our synthetic boxes do; the reference's files
    and .npy files do not: then unknown)."""
    files = volume_files(cfg, split)
    declared = Normalization.from_attrs(target_attributes(files)).temperature_log_range
    if cfg.temperature_log_range is None:
        return Normalization(declared)
    if declared is not None and declared != cfg.temperature_log_range:
        log.warning(
            "temperature_log_range %g differs from the %g that %s declares: the config's is used",
            cfg.temperature_log_range,
            declared,
            files.targets,
        )
    return Normalization(cfg.temperature_log_range)


def validation_share(num_samples: int, batch: int, last_batch: str, *, rank: int, world_size: int) -> tuple[int, int]:
    """(first global index, count) of the validation samples that ``rank`` evaluates.

    ``partial``: all samples, spread as evenly as the ranks allow (the last batch may be smaller);
    ``drop``: only what fills whole batches on every rank.
    """
    if last_batch == "drop":
        count = num_samples // world_size // batch * batch
        return rank * count, count
    base, extra = divmod(num_samples, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(kw_only=True)
class RunData:
    """A run's volumes, opened and checked, and how its loaders keep and cut them."""

    sampling: Sampling  # what the loaders draw
    settings: LoaderSettings  # its storage is what this device can do of cfg.storage; its backend, auto resolved
    train: VolumePair
    val: VolumePair
    node: Node  # shares loaded copies among this node's ranks

    def _loader(
        self, volumes: VolumePair, plan: DrawPlan, device: Device, *, dtype: torch.dtype, split: str, **position: int
    ) -> Any:
        cfg = self.sampling
        augmenter = Augmenter(
            in_channels=cfg.N_in_channels,
            out_channels=cfg.N_out_channels,
            in_vectors=cfg.input_vectors,
            out_vectors=cfg.target_vectors,
        )
        where = torch.device(device.type, device.index)
        return build_loader(
            volumes,
            plan,
            augmenter,
            settings=self.settings,
            device=where,
            dtype=dtype,
            node=self.node,
            split=split,
            **position,
        )

    def train_loader(
        self,
        dist: DistEnv,
        micro: int,
        accumulation: int,
        *,
        steps_per_epoch: int,
        device: Device,
        dtype: torch.dtype,
        first_epoch: int = 0,
        first_batch: int = 0,
    ) -> Any:
        """This rank's training loader, from ``first_batch`` of ``first_epoch``."""
        cfg = self.sampling
        streams = accumulation if cfg.accumulate_as_ranks else 1  # each a rank's of a run without accumulation
        plan = DrawPlan(
            seed=cfg.seed + dist.rank * streams,
            interleave=streams,
            num_samples=steps_per_epoch * micro * accumulation,
            batch_size=micro,
            box_size=self.train.box_size,
            crop_size=cfg.data_size,
            rotate=cfg.rotate,
        )
        position = {"first_epoch": first_epoch, "first_batch": first_batch}
        return self._loader(self.train, plan, device, dtype=dtype, split="train", **position)

    def val_loader(self, dist: DistEnv, micro: int, device: Device, *, dtype: torch.dtype) -> Any:
        """This rank's share of the validation samples."""
        cfg = self.sampling
        first, count = validation_share(
            cfg.Nsamples_val, micro, cfg.last_batch, rank=dist.rank, world_size=dist.world_size
        )
        if count == 0:
            raise ConfigError(
                f"Nsamples_val {cfg.Nsamples_val} leaves rank {dist.rank} no validation samples "
                f"({dist.world_size} rank(s), batch {micro}, last_batch {cfg.last_batch})"
            )
        if cfg.last_batch == "drop" and count * dist.world_size != cfg.Nsamples_val:
            log.warning("validating on %d of %d samples (last_batch: drop)", count * dist.world_size, cfg.Nsamples_val)
        plan = DrawPlan(
            seed=cfg.seed,
            num_samples=count,
            batch_size=micro,
            box_size=self.val.box_size,
            crop_size=cfg.data_size,
            rotate=False,
            validation=True,
            first_index=first,
        )
        return self._loader(self.val, plan, device, dtype=dtype, split="val")


def build_data(cfg: Config, dist: DistEnv, device: Device) -> RunData:
    """The volumes opened and checked (shapes, channels, NaN or Inf), the storage mode (``auto`` chosen by what
    fits) and backend for this device, said once with the keys they leave unused, and the memory they need checked."""
    if cfg.science_box_size is not None and not cfg.science_every_epochs:
        log.warning("science_box_size has no effect without science_every_epochs")
    train, val = (
        VolumePair.open(volume_files(cfg, split), cfg.N_in_channels, cfg.N_out_channels, crop_size=cfg.data_size)
        for split in ("train", "val")
    )
    if cfg.science_box_size is not None and cfg.science_box_size > val.box_size:
        raise ConfigError(f"science_box_size {cfg.science_box_size} is larger than the validation box ({val.box_size})")
    micro = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, dist.world_size).micro_batch
    channels = cfg.N_in_channels + cfg.N_out_channels
    storage = (
        STORAGES[cfg.storage].for_device(device.type)
        if cfg.storage != "auto"
        else _auto_storage(cfg, dist, device, volumes=[train, val], micro=micro)
    )
    backend = resolve_backend(cfg.backend, device.type, storage)
    if cfg.backend == "auto":
        log.info("backend: %s (auto, on a %s, storage %s)", backend, "GPU" if device.type == "cuda" else "CPU", storage)
    if backend == DALI and not dali_installed():
        raise ConfigError(
            "backend: dali needs NVIDIA DALI, not installed here (requirements.txt); or set backend: torch"
        )
    for key in unused_data_keys(cfg, storage, backend, device_type=device.type):
        log.warning("%s has no effect with storage '%s' (backend %s)", key, storage, backend)
    if storage is LAZY and train.files.reader != "bricks" and dist.is_main:  # once, not once per rank
        _say_the_layout_is_slow(cfg, train.files)
    node = node_of(dist, device)
    if cfg.data_checks != "none":  # by each node's first rank: a box is read once per node
        for volumes in (train, val):
            check = lambda v=volumes: v.check_finite(cfg.data_size, seed=cfg.seed)  # noqa: E731
            node.on_first(check, f"the data check of {volumes.files.inputs}")
    settings = LoaderSettings(
        backend=backend,
        storage=storage,
        device_storage_dtype=cfg.device_storage_dtype,
        threads=cfg.num_data_workers,
        lookahead=cfg.data_prefetch,
        channels_last=channels_last_on(cfg, device.type),
    )
    reader = volume_files(cfg, "train").reader
    buffers = batch_buffer_bytes(settings, micro, cfg.data_size, channels=channels, reader=reader)
    check_memory(
        [train, val],
        storage,
        buffer_bytes=buffers,
        local_ranks=dist.local_world_size,
        device_dtype=cfg.device_storage_dtype,
    )
    return RunData(sampling=cfg.sampling, settings=settings, train=train, val=val, node=node)


def _say_the_layout_is_slow(cfg: Config, files: VolumeFiles) -> None:
    """Storage lazy reads each crop from a layout that reads many times the bytes the crop holds: once, the command
    that converts the files into bricks."""
    if files.reader == "hdf5":
        layout, sources = "HDF5", " ".join(str(volume_files(cfg, split).inputs) for split in ("train", "val"))
    else:
        layout, sources = f"npy {files.npy_layout}", "(the HDF5 files these came from)"
    log.warning(
        "storage 'lazy' reads each crop from %s (%s), a layout that reads 9 to 18 times the bytes of bricks from a "
        "cold cache (docs/data.md, At full scale): python -m pipeline.convert %s --out_dir DIR, then train with "
        "--data_format npy --npy_layout bricks and the paths it prints",
        files.inputs,
        layout,
        sources,
    )


def _auto_storage(cfg: Config, dist: DistEnv, device: Device, *, volumes: list[VolumePair], micro: int) -> StorageMode:
    """``storage: auto``: what fits, by ``choose_storage``; every rank takes the most frugal choice any rank made
    (a node with less memory, a GPU with less free), so that they keep their volumes alike."""
    ds_config = engine_config(cfg, dist.world_size, device.type)
    training = training_bytes(
        UNetSpec.from_config(to_dict(cfg)), crop=cfg.data_size, micro_batch=micro, precision=precision_of(ds_config)
    )
    on_gpu = device.type == "cuda"
    budget = dict(
        volume_bytes=sum(v.nbytes for v in volumes),
        on_gpu=device_bytes(volumes, cfg.device_storage_dtype) if on_gpu else None,
        gpu_free=torch.cuda.mem_get_info(device.index)[0] if on_gpu else None,
        training=training,
        host_available=available_host_bytes(),
        local_ranks=dist.local_world_size,
    )
    mine, why = choose_storage(buffer_bytes=_auto_buffer_bytes(cfg, micro), **budget)
    order = list(STORAGES.values())  # the least memory first
    choice = torch.tensor(
        [float(order.index(mine))], device=torch.device(device.type, device.index) if on_gpu else "cpu"
    )
    torch_dist.all_reduce(choice, op=torch_dist.ReduceOp.MIN)
    agreed = order[int(choice.item())]
    if agreed is mine:
        log.info("storage auto: %s (%s)", agreed, why)
    else:
        log.info("storage auto: %s, as another rank could not keep them so (here: %s, as %s)", agreed, mine, why)
    return agreed


def _auto_buffer_bytes(cfg: Config, micro: int) -> int:
    """The batch buffers host storage would take per rank, for ``storage: auto`` to weigh."""
    settings = LoaderSettings(
        backend=resolve_backend(cfg.backend, "cpu", HOST) if cfg.backend == "auto" else cfg.backend,
        storage=HOST,
        device_storage_dtype=cfg.device_storage_dtype,
        threads=cfg.num_data_workers,
        lookahead=cfg.data_prefetch,
    )
    channels = cfg.N_in_channels + cfg.N_out_channels
    reader = volume_files(cfg, "train").reader
    return batch_buffer_bytes(settings, micro, cfg.data_size, channels=channels, reader=reader)


def node_of(dist: DistEnv, device: Device) -> Node:
    """This rank's node for the shared copies: its place there, how the ranks agree (one small all-reduce), and the
    name rank 0 gives this run's segments."""
    where = torch.device(device.type, device.index) if device.type == "cuda" else torch.device("cpu")

    def agree(*, failed: bool) -> bool:
        return on_any_rank(where, flag=failed)

    key = [f"{os.getuid()}-{os.getpid()}-{time.strftime('%Y%m%d%H%M%S')}"]
    torch_dist.broadcast_object_list(key, src=0)
    return Node(local_rank=dist.local_rank, local_ranks=dist.local_world_size, agree=agree, key=key[0])
