"""The DeepSpeed side: batch arithmetic, the DeepSpeed JSON filled in Python, the engine itself.

DeepSpeed owns micro-batch, accumulation and precision; the rest of the program asks the engine
for them (``engine.train_micro_batch_size_per_gpu()``, ``engine.fp16_enabled()``...).
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.dist import is_main_process
from trainer.errors import ConfigError
from trainer.op_builds import jit_built, settle_build_lock

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


# What takes DeepSpeed's FusedAdam's place where it cannot be built: torch's own fused Adam, the same math.
TORCH_FUSED_ADAM = {"torch_adam": True, "fused": True}


def _ninja_dirs() -> list[str]:
    """Where a ninja that is not on PATH may be: beside this interpreter (a virtual environment not activated), and
    the bin directory beside the ninja package (wheels installed with pip --target SITE put it in SITE/bin)."""
    dirs = [str(Path(sys.executable).parent)]
    spec = importlib.util.find_spec("ninja")
    if spec is not None and spec.origin is not None:
        dirs.append(str(Path(spec.origin).parent.parent / "bin"))
    return dirs


# An entry of TORCH_CUDA_ARCH_LIST as torch reads it: '9.0', '9.0+PTX', and with an arch suffix, '9.0a' or '10.0f'.
_ARCH = re.compile(r"(\d+)\.(\d+)[a-z]*(\+PTX)?")


def _arch_entries(value: str) -> list[str]:
    """The entries of a TORCH_CUDA_ARCH_LIST value, which torch separates by ';' or spaces."""
    return [entry.strip() for entry in value.replace(" ", ";").split(";") if entry.strip()]


def parseable_arch_list(value: str, device_capability: tuple[int, int] | None) -> str:
    """TORCH_CUDA_ARCH_LIST ``value`` in the form DeepSpeed's op builder parses, 'major.minor' with an optional
    '+PTX' (0.19.8 does int('0a') on '9.0a', and its JIT build dies): arch suffixes dropped, as FusedAdam uses no
    arch-specific instruction; a list with other entries (torch's named architectures) replaced by the device's own
    capability. ValueError where neither can be had."""
    matches = [_ARCH.fullmatch(entry) for entry in _arch_entries(value)]
    if all(matches):
        return ";".join(dict.fromkeys(f"{m[1]}.{m[2]}{m[3] or ''}" for m in matches if m is not None))
    if device_capability is None:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST '{value}' has entries DeepSpeed cannot parse, and no GPU is visible")
    return "{}.{}".format(*device_capability)


@functools.cache
def fit_arch_list() -> str | None:
    """Give this process a TORCH_CUDA_ARCH_LIST that DeepSpeed can parse (``parseable_arch_list``), saying so in one
    line; DeepSpeed's ``jit_load`` parses it in every process that loads an op, built before or not. Returns why it
    could not, or None."""
    import deepspeed

    value = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if not value.strip():
        return None  # DeepSpeed asks the visible devices
    try:
        fitted = parseable_arch_list(value, torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    except ValueError as err:
        return str(err)
    if fitted.split(";") != _arch_entries(value):
        os.environ["TORCH_CUDA_ARCH_LIST"] = fitted
        if is_main_process():
            log.info(
                "TORCH_CUDA_ARCH_LIST '%s' set to '%s' in this process, which DeepSpeed %s can parse",
                value,
                fitted,
                deepspeed.__version__,
            )
    return None


def arch_list_problem(builder: Any) -> str | None:
    """What DeepSpeed's own parsing of TORCH_CUDA_ARCH_LIST says, for a builder of CUDA ops: None where it parses.
    Run as ``jit_load`` would, with the variable (which the parsing rewrites) and the builder's mode restored."""
    if not hasattr(builder, "compute_capability_args"):
        return None  # not a CUDA op
    value, jit_mode = os.environ.get("TORCH_CUDA_ARCH_LIST"), builder.jit_mode
    builder.jit_mode = True
    try:
        builder.compute_capability_args()
    except Exception as err:  # ValueError from int(), RuntimeError for no devices, and whatever a new version raises
        return f"DeepSpeed cannot use TORCH_CUDA_ARCH_LIST '{value or ''}' ({type(err).__name__}: {err})"
    finally:
        builder.jit_mode = jit_mode
        if value is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = value
    return None


@functools.cache
def fused_adam_problem() -> str | None:
    """Why DeepSpeed's FusedAdam cannot be loaded here, or None where it can: an arch list DeepSpeed can parse
    (``fit_arch_list``), and installed prebuilt, JIT-built before (cached), or buildable (ninja on PATH, beside this
    interpreter or in the ninja package, and a CUDA toolkit whose nvcc matches the CUDA that torch was built with).
    A failed JIT build is a traceback deep inside deepspeed.initialize; this says why before it starts. Probed once
    per process."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.builder import assert_no_cuda_mismatch

    builder = get_accelerator().create_op_builder("FusedAdamBuilder")
    if builder is None:
        return f"DeepSpeed has no FusedAdam for the {get_accelerator().device_name()} accelerator"
    if installed_ops.get(builder.name, False):
        return None  # prebuilt: nothing is compiled, the arch list is not read
    if problem := fit_arch_list() or arch_list_problem(builder):  # parsed even where the op was built before
        return problem
    settle_build_lock(builder.name, clears=os.environ.get("LOCAL_RANK", "0") == "0")  # exported by dist.export()
    if jit_built(builder.name)[0]:
        return None
    if shutil.which("ninja") is None:
        found = [d for d in _ninja_dirs() if shutil.which("ninja", path=d)]
        if not found:
            return "ninja is not on PATH (pip install ninja)"
        os.environ["PATH"] = found[0] + os.pathsep + os.environ.get("PATH", "")  # where torch's JIT build looks
    if not hasattr(builder, "compute_capability_args"):
        return None  # the accelerator's own op (a CPU's), built with the host compiler
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    try:
        assert_no_cuda_mismatch(builder.name)
    except Exception as err:  # DeepSpeed's MissingCUDAException, CUDAMismatchException
        return " ".join(str(err).replace(">- ", "").split())
    return None


def resolve_ds_config(template: dict[str, Any], plan: BatchPlan, lr: float, device_type: str) -> dict[str, Any]:
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


def train_dtype(engine: Any) -> torch.dtype:
    """The dtype the engine's model computes in, which is what the pipeline must deliver."""
    if engine.fp16_enabled():
        return torch.float16
    if engine.bfloat16_enabled():
        return torch.bfloat16
    return torch.float32


def precision_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def loss_scale(engine: Any) -> float | None:
    """The current dynamic loss scale under fp16, else None."""
    return float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None


# Per fp16 engine, once its first backward has shown it: whether DeepSpeed's backward applies the loss scale itself.
_SCALES_ITSELF: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def backward(engine: Any, loss: torch.Tensor) -> None:
    """``engine.backward(loss)`` with fp16's loss scale applied exactly once.

    Under fp16 every DeepSpeed optimizer divides the gradients by its loss scale in ``step()``, but DeepSpeed's
    ``engine.backward`` multiplies the loss by it only for its ZeRO optimizers and torch's GradScaler: 0.19.8 leaves
    the fp16 wrappers of ZeRO stage 0 unscaled (deepspeedai/DeepSpeed#8393). There the gradients of an L1 mean over
    2^25 outputs or more are below fp16's smallest number, all exactly zero, and nothing overflows. So the first
    backward of each fp16 engine shows what DeepSpeed does: a hook on the loss sees the gradient that reaches it,
    the factor DeepSpeed multiplied the loss by (1/accumulation, times the loss scale where it applies it). Where it
    does not, the hook applies the scale to that backward, and later ones multiply the loss by the scale; where it
    does (ZeRO, a fixed DeepSpeed), nothing changes. The loss stays float32 (``model.Loss``): scaled by 2^16, it
    would overflow float16. bf16 and fp32 engines are left as they are.
    """
    if not engine.fp16_enabled():
        engine.backward(loss)
        return
    scale = loss_scale(engine)
    scales_itself = _SCALES_ITSELF.get(engine)
    if scales_itself is None and scale != 1.0:  # a scale of 1 cannot tell: the next backward asks again
        handle = loss.register_hook(functools.partial(_probe_scaling, engine, scale))
        try:
            engine.backward(loss)
        finally:
            handle.remove()
    else:
        engine.backward(loss if scales_itself is not False else loss * scale)


def _probe_scaling(engine: Any, scale: float, grad: torch.Tensor) -> torch.Tensor:
    """The hook of ``backward``'s first fp16 backward: decides, says which, and scales this backward if needed."""
    import deepspeed

    factor = float(grad) * engine.gradient_accumulation_steps()  # one device sync, once per engine
    scales_itself = math.isclose(factor, scale, rel_tol=1e-3)
    if not scales_itself and not math.isclose(factor, 1.0, rel_tol=1e-3):
        log.warning(
            "fp16: DeepSpeed multiplied the loss by %g, neither 1 nor its loss scale %g: left so", factor, scale
        )
        scales_itself = True
    _SCALES_ITSELF[engine] = scales_itself
    if scales_itself:
        log.info("fp16: DeepSpeed applies its loss scale (%g) in backward", scale)
        return grad
    log.info(
        "fp16: DeepSpeed %s does not apply its loss scale in backward with %s: the trainer does (%g now)",
        deepspeed.__version__,
        type(engine.optimizer).__name__,
        scale,
    )
    return grad * scale
