"""DeepSpeed's GPU fp16 path, run on a CPU: DeepSpeed refuses fp16 on its CPU accelerator, and the trainer turns
fp16 into fp32 there. With both let through, the engine is the one a GPU gets (the fp16 optimizer wrappers, dynamic
loss scaling), computing in float16 on the CPU: slow, but the same numerics.

    python -m tests.fp16_on_cpu ds_train.py-options...   # ds_train.py through that path
"""

from __future__ import annotations

import sys
from typing import Any

from deepspeed.accelerator import get_accelerator

import trainer.engine
from trainer.engine import BatchPlan, merge_settings, resolve_ds_config

# DeepSpeed's FusedAdam has no CPU build worth its 45 s compile: torch's Adam, unless the config says otherwise.
TORCH_ADAM = {"optimizer": {"params": {"torch_adam": True}}}


def gpu_ds_config(template: dict[str, Any], plan: BatchPlan, lr: float, device_type: str = "cuda") -> dict[str, Any]:
    """The DeepSpeed config a GPU would get from ``template``, whatever ``device_type`` is asked for."""
    return resolve_ds_config(merge_settings(TORCH_ADAM, template), plan, lr, device_type="cuda")


def allow_fp16_on_cpu() -> None:
    """Let DeepSpeed build fp16 engines on the CPU, and the trainer keep fp16 in their configs (as on a GPU)."""
    get_accelerator().is_fp16_supported = lambda: True
    trainer.engine.resolve_ds_config = gpu_ds_config


if __name__ == "__main__":
    allow_fp16_on_cpu()
    import ds_train

    sys.exit(ds_train.main(sys.argv[1:]))
