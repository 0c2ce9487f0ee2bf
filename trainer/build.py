"""Building what a run trains with from its config, as the trainer, the benchmarks and the tests do alike:
``build_data`` (a ``RunData``: the volumes, opened and checked, and how its loaders cut them) and ``build_engine``
(the model, the DeepSpeed config, the schedule, the engine). Bad data, and data that cannot fit, are found before the
engine is built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as torch_dist

from common.tensors import precision_name
from model import Loss, UNet, UNetSpec
from model.loss import MissingInput
from model.memory import training_bytes
from model.metrics import Normalization
from pipeline.layout import TEMPERATURE
from pipeline.loaders import LoaderSettings, batch_buffer_bytes, build_loader, dali_installed, resolve_backend
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.shared import Node
from pipeline.storage import (
    DEVICE,
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
from trainer.dist import Device, DistEnv
from trainer.engine import (
    load_ds_template,
    plan_batches,
    precision_of,
    resolve_ds_config,
    skip_single_rank_reduction,
    train_dtype,
)
from trainer.errors import ConfigError
from trainer.fused_adam import TORCH_FUSED_ADAM
from trainer.lr_schedule import ScaledCosineSchedule, peak_lr, warmup_applies

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


def build_loss(cfg: Config) -> Loss:
    """The loss the config asks for: every ``lambda_*`` key of the same name as the loss's weight; a temperature term
    in physical units needs the training file's normalization or the config's, never a guess."""
    try:
        return Loss(
            **{name: getattr(cfg, name) for name in Loss.weights()},
            temperature_log_range=normalization(cfg, "train").temperature_log_range,
            velocity=tuple(cfg.target_vectors[0]) if cfg.target_vectors else None,  # the gas velocity's group
        )
    except MissingInput as err:
        if err.needs != "temperature_log_range":
            raise ConfigError(f"{err.what}: set {err.needs}") from None
        raise ConfigError(
            f"{err.what}, which {volume_files(cfg, 'train').targets} does not declare: set temperature_log_range "
            f"(channel {TEMPERATURE} holds log10(T / T0) / temperature_log_range)"
        ) from None


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

    cfg: Config
    settings: LoaderSettings  # its storage is what this device can do of cfg.storage; its backend, auto resolved
    train: VolumePair
    val: VolumePair
    node: Node  # shares loaded copies among this node's ranks

    def _loader(
        self, volumes: VolumePair, plan: DrawPlan, device: Device, *, dtype: torch.dtype, split: str, **position: int
    ) -> Any:
        cfg = self.cfg
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
        cfg = self.cfg
        plan = DrawPlan(
            seed=cfg.seed + dist.rank,
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
        cfg = self.cfg
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
    if backend == "dali" and not dali_installed():
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
    return RunData(cfg=cfg, settings=settings, train=train, val=val, node=node)


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
    order = [LAZY, HOST, DEVICE]
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
        flag = torch.tensor([float(failed)], device=where)
        torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
        return bool(flag.item())

    key = [f"{os.getuid()}-{os.getpid()}-{time.strftime('%Y%m%d%H%M%S')}"]
    torch_dist.broadcast_object_list(key, src=0)
    return Node(local_rank=dist.local_rank, local_ranks=dist.local_world_size, agree=agree, key=key[0])


def engine_config(cfg: Config, world_size: int, device_type: str) -> dict[str, Any]:
    """The DeepSpeed config of a run: the JSON with its overrides, the batch split over ``world_size`` ranks, and
    the peak learning rate (``lr_schedule.start_lr`` scaled to the global batch), computed here and nowhere else."""
    sched = cfg.lr_schedule
    return resolve_ds_config(
        load_ds_template(cfg.deepspeed_config, cfg.deepspeed_overrides),
        plan_batches(cfg.global_batch_size, cfg.micro_batch_size, world_size),
        peak_lr(sched.start_lr, sched.scaling, cfg.global_batch_size, base_batch=cfg.base_batch_size),
        device_type=device_type,
    )


def build_model(cfg: Config) -> UNet:
    """The config's U-Net, seeded and initialized as the reference does, with the config's fast paths."""
    torch.manual_seed(cfg.seed)
    model = UNetSpec.from_config(to_dict(cfg)).build()
    model.init_weights(cfg.weight_init.conv_scale, cfg.weight_init.conv_bias)
    if cfg.pad_last_layer:
        model.pad_last_layer(8)
    return model


@dataclass(kw_only=True)
class EngineSetup:
    """DeepSpeed's engine and what was decided with it."""

    engine: Any
    schedule: ScaledCosineSchedule
    ds_config: dict[str, Any]
    dtype: torch.dtype  # of the batches the engine trains on
    parameters: int
    steps_per_epoch: int


def set_cudnn(cfg: Config, device_type: str) -> None:
    """cuDNN's autotuning as the config asks (on a GPU, on unless cudnn_benchmark is false); one warning for each
    setting that cannot work here."""
    if device_type == "cpu":
        if cfg.cudnn_benchmark:
            log.warning("cudnn_benchmark has no effect without a GPU")
        if cfg.cudnn_benchmark_limit is not None:
            log.warning("cudnn_benchmark_limit has no effect without a GPU")
        return
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark is not False
    if cfg.cudnn_benchmark_limit is None:
        return
    if torch.backends.cudnn.benchmark:
        torch.backends.cudnn.benchmark_limit = cfg.cudnn_benchmark_limit
    else:
        log.warning("cudnn_benchmark_limit has no effect with cudnn_benchmark: false")


def build_engine(cfg: Config, dist: DistEnv, device: Device) -> EngineSetup:
    """The model (seeded, initialized as the reference does), DeepSpeed's engine over it with our schedule, the
    single-rank reduction skipped, compiled if asked; and the process's threads and cuDNN set for the device."""
    set_cudnn(cfg, device.type)
    if device.type == "cpu":
        torch.set_num_threads(cfg.cpu_threads or max(1, len(os.sched_getaffinity(0)) // dist.local_world_size))
    elif cfg.cpu_threads:
        log.warning("cpu_threads has no effect when training on a GPU")
    steps_per_epoch = cfg.Nsamples // cfg.global_batch_size
    sched = cfg.lr_schedule
    if sched.warmup_steps and not warmup_applies(sched.scaling, cfg.global_batch_size, cfg.base_batch_size):
        log.info("no lr warm-up: it applies only when the lr is scaled up (scaling != none, global > base batch)")
    ds_config = engine_config(cfg, dist.world_size, device.type)

    model = build_model(cfg)

    def make_schedule(optimizer: torch.optim.Optimizer) -> ScaledCosineSchedule:
        return ScaledCosineSchedule(
            optimizer,
            start_lr=sched.start_lr,
            end_lr=sched.end_lr,
            warmup_steps=sched.warmup_steps,
            total_steps=cfg.num_epochs * steps_per_epoch,
            scaling=sched.scaling,
            global_batch=cfg.global_batch_size,
            base_batch=cfg.base_batch_size,
        )

    try:
        engine, _, _, schedule = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config, lr_scheduler=make_schedule
        )
    except (ValueError, TypeError, AssertionError) as err:  # DeepSpeed's own config checks (pydantic's span lines)
        what = cfg.deepspeed_config + (" with deepspeed_overrides" if cfg.deepspeed_overrides else "")
        raise ConfigError(f"DeepSpeed rejected {what}: {' '.join(str(err).split())}") from None
    except RuntimeError as err:  # a JIT build of DeepSpeed's FusedAdam that the probe could not foresee
        if "fused_adam" not in str(err):
            raise
        override = json.dumps({"optimizer": {"params": TORCH_FUSED_ADAM}})
        raise ConfigError(
            f"DeepSpeed could not build FusedAdam ({str(err).strip().splitlines()[0]}); "
            f"--deepspeed_overrides '{override}' trains with torch's fused Adam"
        ) from None
    schedule.follow(engine)  # steps skipped for overflow count: the schedule is at the engine's step
    skip_single_rank_reduction(engine)
    if cfg.compile:  # torch.compile of the module, through the engine (compiled on the first step)
        engine.compile(compile_kwargs={} if cfg.compile_mode == "default" else {"mode": cfg.compile_mode})
    elif cfg.compile_mode != "default":
        log.warning("compile_mode has no effect without compile: true")
    parameters = sum(p.numel() for p in model.parameters())
    return EngineSetup(
        engine=engine,
        schedule=schedule,
        ds_config=ds_config,
        dtype=train_dtype(engine),
        parameters=parameters,
        steps_per_epoch=steps_per_epoch,
    )


def run_facts(setup: EngineSetup, data: RunData, dist: DistEnv) -> dict[str, Any]:
    """What a run trains with, under the same keys in its summary.json and in the benchmarks' records."""
    engine = setup.engine
    return {
        "world_size": dist.world_size,
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "accumulation": engine.gradient_accumulation_steps(),
        "global_batch": engine.train_batch_size(),
        "precision": precision_name(setup.dtype),
        "zero_stage": engine.zero_optimization_stage(),
        "storage": data.settings.storage.name,
        "backend": data.settings.backend,
        "parameters": setup.parameters,
    }
