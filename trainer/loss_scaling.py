"""fp16's loss scale, applied exactly once whatever DeepSpeed's backward does with it."""

from __future__ import annotations

import functools
import logging
import math
import weakref
from typing import Any

import torch

log = logging.getLogger(__name__)


def loss_scale(engine: Any) -> float | None:
    """The current dynamic loss scale under fp16, else None."""
    return float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None


# Per fp16 engine, once its first backward has shown it: whether DeepSpeed's backward applies the loss scale itself.
_SCALES_ITSELF: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def backward(engine: Any, loss: torch.Tensor) -> None:
    """``engine.backward(loss)`` with fp16's loss scale applied exactly once.

    DeepSpeed 0.19.8 divides fp16 gradients by the loss scale in ``step()`` but, at ZeRO stage 0, never multiplies the
    loss by it (deepspeedai/DeepSpeed#8393): the first fp16 backward sees, by a hook on the loss, the factor DeepSpeed
    applied, and the scale is applied here where it was not (docs/training.md, fp16). bf16 and fp32 are left alone.
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
