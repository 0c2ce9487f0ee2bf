"""What training the U-Net takes of a device's memory, estimated without running it: the parameters with their
gradients and Adam's state, and the activations a micro-batch keeps for its backward pass (counted exactly, from a
forward pass on the meta device) and the gradients that flow back beside them. docs/data.md (At full scale) gives
the estimate for the reference's model and how it compares with measured peaks."""

from __future__ import annotations

import torch

from common.tensors import DTYPES
from model.unet import UNetSpec

# Per parameter: its weight, its gradient and Adam's two moments in float32 (16 bytes); under fp16 or bf16, the half
# weight and gradient the engine computes with beside the float32 master weight and gradient (20 bytes).
BYTES_PER_PARAMETER = {"fp32": 16, "bf16": 20, "fp16": 20}
BACKWARD_FACTOR = 2.0  # the activations kept, and the gradients of as many that flow back beside them at the peak


def saved_activation_bytes(spec: UNetSpec, *, crop: int, precision: str) -> int:
    """Bytes of the tensors one sample's forward pass keeps for its backward pass (weights not counted)."""
    dtype = DTYPES[precision]
    with torch.device("meta"):
        model = spec.build().to(dtype)
    weights = {id(p) for p in model.parameters()}
    saved = [0]

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in weights and not isinstance(tensor, torch.nn.Parameter):
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    sample = torch.empty(1, spec.in_channels, crop, crop, crop, device="meta", dtype=dtype)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(sample)
    return saved[0]


def training_bytes(spec: UNetSpec, *, crop: int, micro_batch: int, precision: str) -> int:
    """Device memory of a training step at its peak: the parameters' state and a micro-batch's activations."""
    parameters = _parameters(spec)
    activations = saved_activation_bytes(spec, crop=crop, precision=precision)
    return int(parameters * BYTES_PER_PARAMETER[precision] + micro_batch * activations * BACKWARD_FACTOR)


def _parameters(spec: UNetSpec) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in spec.build().parameters())
