"""The DeepSpeed side: batch arithmetic, the DeepSpeed JSON filled in Python, the engine itself.

DeepSpeed owns micro-batch, accumulation and precision; the rest of the program asks the engine
for them (``engine.train_micro_batch_size_per_gpu()``, ``engine.fp16_enabled()``...).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.tensors import DTYPES
from trainer.config import Config
from trainer.dist import is_main_process
from trainer.errors import ConfigError
from trainer.fused_adam import TORCH_FUSED_ADAM, fused_adam_problem
from trainer.lr_schedule import peak_lr

log = logging.getLogger(__name__)

# DeepSpeed's step prints go to its own logger every steps_per_print steps; ours report instead.
_QUIET_STEPS = 2**31 - 1

# DeepSpeed's top-level sections that are not among its runtime constants (its config documentation), and the
# sections this program reads as mappings. A key close to one of these but not one is a typo: DeepSpeed would
# ignore it silently.
_SECTIONS = {
    "zero_optimization",
    "timers",
    "flops_profiler",
    "activation_checkpointing",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "compile",
    "data_efficiency",
    "curriculum_learning",
    "autotuning",
    "elasticity",
    "aio",
    "nebula",
    "amp",
    "sparse_attention",
    "pipeline",
    "hybrid_engine",
    "eigenvalue",
    "progressive_layer_drop",
    "compression_training",
    "weight_quantization",
    "quantize_training",
    "sparse_gradients",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "checkpoint",
    "data_types",
    "sequence_parallel_size",
    "tensor_parallel",
    "expert_parallel",
    "dynamic_batching",
}
_MAPPINGS = ("fp16", "bf16", "optimizer", "zero_optimization", "timers")


def check_sections(cfg: dict[str, Any]) -> None:
    """Refuse top-level keys that look like typos of DeepSpeed's, and sections that should be mappings."""
    from deepspeed.runtime import constants

    known = _SECTIONS | {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    for key in cfg:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8) if key not in known else []
        if close:
            raise ConfigError(f"DeepSpeed config key '{key}' is not DeepSpeed's (did you mean '{close[0]}'?)")
    for key in _MAPPINGS:
        if key in cfg and not isinstance(cfg[key], dict):
            raise ConfigError(f"DeepSpeed config section '{key}' must be a mapping, got {cfg[key]!r}")


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    accumulation: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size


def plan_batches(global_batch: int, micro_batch: int | None, world_size: int) -> BatchPlan:
    """Micro-batch and accumulation from the global batch and the world size, or a clear error."""
    if global_batch % world_size:
        raise ConfigError(f"global_batch_size {global_batch} is not divisible by the world size {world_size}")
    per_rank = global_batch // world_size
    micro = per_rank if micro_batch is None else micro_batch
    if per_rank % micro:
        raise ConfigError(
            f"global_batch_size {global_batch} over {world_size} rank(s) is {per_rank} per rank, "
            f"not a multiple of micro_batch_size {micro}"
        )
    return BatchPlan(micro, per_rank // micro, world_size)


def merge_settings(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in: mappings key by key, anything else replaced."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_settings(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_ds_template(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON at ``path``, with the experiment's ``deepspeed_overrides`` merged in."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read DeepSpeed config {path}: {err.strerror}") from None
    try:
        template = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    if not isinstance(template, dict):
        raise ConfigError(f"DeepSpeed config {path} must be a JSON object")
    return merge_settings(template, overrides or {})


def resolve_ds_config(template: dict[str, Any], plan: BatchPlan, lr: float, *, device_type: str) -> dict[str, Any]:
    """The DeepSpeed config for this run: batch sizes and lr filled in, precision fitted to the device.

    fp16 with loss scaling is a GPU path: elsewhere it becomes fp32, with a warning. The recipe's
    optimizer semantics are made explicit where DeepSpeed's defaults differ: plain Adam (not AdamW),
    no gradient clipping unless the JSON asks for it.
    """
    cfg = copy.deepcopy(template)
    check_sections(cfg)
    batch = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation,
    }
    for key, value in batch.items():
        if key in cfg and cfg[key] != value:
            raise ConfigError(
                f"DeepSpeed config sets {key}={cfg[key]}, but the experiment's batch settings give {value} "
                f"(global {plan.global_batch} = micro {plan.micro_batch} x accumulation {plan.accumulation} "
                f"x {plan.world_size} rank(s)); remove it from the JSON"
            )
        cfg[key] = value
    if "scheduler" in cfg:
        raise ConfigError(
            "DeepSpeed config has a 'scheduler' section; the schedule is lr_schedule in the experiment config"
        )
    optimizer = cfg.setdefault("optimizer", {"type": "Adam"})
    params = optimizer.setdefault("params", {})
    if "lr" in params:
        raise ConfigError(
            "DeepSpeed config sets optimizer.params.lr; set lr_schedule.start_lr in the experiment config"
        )
    params["lr"] = lr
    if optimizer.get("type", "").lower() in ("adam", "adamw"):  # both DeepSpeed's FusedAdam, or torch's
        if optimizer["type"].lower() == "adam":
            params.setdefault("adam_w_mode", False)
        if device_type == "cpu" and "torch_adam" not in params:
            # FusedAdam's CPU build is a JIT compile of its own for no gain here; torch.optim.Adam is the same math.
            params["torch_adam"] = True
        elif device_type == "cuda" and not params.get("torch_adam") and (problem := fused_adam_problem()):
            if "torch_adam" in params:  # asked for by name: DeepSpeed's build fails with its own message
                log.warning(
                    "DeepSpeed's FusedAdam, which torch_adam: false asks for, cannot be built here (%s)", problem
                )
            else:
                if is_main_process():  # one line for the job, not one per rank
                    log.warning(
                        "DeepSpeed's FusedAdam cannot be built here (%s): training with torch's fused Adam", problem
                    )
                params.update(TORCH_FUSED_ADAM)
    cfg.setdefault("gradient_clipping", 0.0)
    cfg.setdefault("steps_per_print", _QUIET_STEPS)
    # DeepSpeed's throughput timer (on by default) synchronizes the device at every forward and step, so that
    # the host can never queue work ahead; we measure throughput ourselves.
    cfg.setdefault("timers", {}).setdefault("throughput", {}).setdefault("enabled", False)
    if cfg.get("fp16", {}).get("enabled") and device_type != "cuda":
        log.warning(
            "fp16 with loss scaling needs a CUDA GPU; training in fp32 on %s instead "
            "(ds_configs/ds_bf16.json gives bf16)",
            device_type,
        )
        cfg["fp16"] = {"enabled": False}
    return cfg


def skip_single_rank_reduction(engine: Any) -> bool:
    """Turn off the gradient all-reduce after backward where the data-parallel group is one rank.

    DeepSpeed reduces gradients even over a single rank (it flattens them, all-reduces the copy and copies it
    back): an identity that costs memory traffic every step. DeepSpeed skips it itself when it has no communication
    backend; ZeRO stages keep their own reduction, which also partitions. Returns whether it was turned off.
    """
    if engine.dp_world_size == 1 and not engine.zero_optimization():
        engine.enable_backward_allreduce = False
        return True
    return False


def precision_of(ds_config: dict[str, Any]) -> str:
    """The precision a DeepSpeed config trains in: a key of common.tensors.DTYPES."""
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"


def train_dtype(engine: Any) -> torch.dtype:
    """The dtype the engine's model computes in, which is what the pipeline must deliver."""
    return DTYPES["fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"]


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
