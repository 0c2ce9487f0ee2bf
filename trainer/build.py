"""Building what a run trains with from its config, as the trainer, the benchmarks and the tests do alike: the
model, the loss, the DeepSpeed engine with our schedule (``build_engine``), and the facts a run's records carry.
The data is ``trainer.data``'s.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch

from common.tensors import precision_name
from model import Loss, UNet, UNetSpec
from model.loss import MissingInput
from pipeline.layout import TEMPERATURE
from trainer.config import Config, to_dict
from trainer.data import RunData, normalization, volume_files
from trainer.dist import Device, DistEnv
from trainer.engine import engine_config, skip_single_rank_reduction, train_dtype
from trainer.errors import ConfigError
from trainer.fused_adam import TORCH_FUSED_ADAM
from trainer.lr_schedule import Schedule, make_schedule, warmup_applies
from trainer.reduction import OverlappedReduction

log = logging.getLogger(__name__)


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
    schedule: Schedule
    ds_config: dict[str, Any]
    dtype: torch.dtype  # of the batches the engine trains on
    parameters: int
    steps_per_epoch: int
    reduction: OverlappedReduction | None = None  # gradient_reduction: overlapped, where it applies


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


def overlapped_reduction(cfg: Config, engine: Any) -> OverlappedReduction | None:
    """``gradient_reduction: overlapped`` where it can take effect: stage 0 on several ranks (else one warning)."""
    if cfg.gradient_reduction != "overlapped":
        if cfg.reduce_bucket_mb != Config.__dataclass_fields__["reduce_bucket_mb"].default:
            log.warning("reduce_bucket_mb has no effect without gradient_reduction: overlapped")
        return None
    if engine.zero_optimization():
        log.warning(
            "gradient_reduction: overlapped has no effect under ZeRO stage %d (its own reduction)",
            engine.zero_optimization_stage(),
        )
        return None
    if engine.dp_world_size == 1:
        log.warning("gradient_reduction: overlapped has no effect on one rank (nothing to reduce)")
        return None
    grad_dtype = next(engine.module.parameters()).dtype
    averaging = engine.gradient_average and engine.postscale_gradients() and engine.gradient_predivide_factor() == 1
    if engine.communication_data_type != grad_dtype or not averaging:
        raise ConfigError(
            "gradient_reduction: overlapped reduces the gradients in their own precision and averages them after "
            "the sum; the DeepSpeed config asks otherwise (communication_data_type, prescale_gradients or "
            "gradient_predivide_factor): drop those settings, or use gradient_reduction: after_backward"
        )
    element = next(engine.module.parameters()).element_size()
    reduction = OverlappedReduction(engine, bucket_elements=int(cfg.reduce_bucket_mb * 2**20 / element))
    log.info(
        "gradient reduction: overlapped with backward, %d bucket(s) of up to %g MiB (a larger weight goes alone)",
        len(reduction.buckets),
        cfg.reduce_bucket_mb,
    )
    return reduction


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

    def schedule_of(optimizer: torch.optim.Optimizer) -> Schedule:
        total = cfg.num_epochs * steps_per_epoch
        return make_schedule(
            optimizer, sched, total_steps=total, global_batch=cfg.global_batch_size, base_batch=cfg.base_batch_size
        )

    try:
        engine, _, _, schedule = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config, lr_scheduler=schedule_of
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
    reduction = overlapped_reduction(cfg, engine)
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
        reduction=reduction,
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
