"""Facts about tensors that every layer shares: the precisions by name, and a digest of values."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

# The precisions the project trains and predicts in, by the name configs, records and options use.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_name(dtype: torch.dtype) -> str:
    """The name of ``dtype`` among DTYPES."""
    return next(name for name, known in DTYPES.items() if known == dtype)


def tensor_digest(tensors: Any) -> str:
    """sha256 of tensors' float32 values, in order: equal digests, equal values."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
