"""Whether DeepSpeed's FusedAdam can be loaded here, asked before ``deepspeed.initialize`` (where a failed JIT build
is a traceback deep inside it), and a TORCH_CUDA_ARCH_LIST that DeepSpeed's op builder can parse."""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

import torch

from trainer.dist import is_main_process
from trainer.op_builds import jit_built, settle_build_lock, use_environment_ninja

log = logging.getLogger(__name__)

# What takes DeepSpeed's FusedAdam's place where it cannot be built: torch's own fused Adam, the same math.
TORCH_FUSED_ADAM = {"torch_adam": True, "fused": True}


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
    has_ninja = use_environment_ninja()  # torch runs ninja on every load, a build from before included
    if jit_built(builder.name)[0]:
        return None
    if not has_ninja:
        return "ninja is not on PATH (pip install ninja)"
    if not hasattr(builder, "compute_capability_args"):
        return None  # the accelerator's own op (a CPU's), built with the host compiler
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    try:
        assert_no_cuda_mismatch(builder.name)
    except Exception as err:  # DeepSpeed's MissingCUDAException, CUDAMismatchException
        return " ".join(str(err).replace(">- ", "").split())
    return None
