"""FLOPs per sample, counted from the model, and peak FLOP/s per device, each with its source.

FLOPs come from PyTorch's FlopCounterMode over one forward and backward pass of one sample, run on
the meta device (no memory, no compute): for the reference U-Net at 64^3 that is 27.2 GFLOP forward
and 80.5 GFLOP per training sample, as the tutorial states. MFU is achieved FLOP/s over the device's
peak for the precision trained in.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from model import UNetSpec
from trainer.provenance import cpu_info

# Dense (no sparsity) peaks from the vendors' datasheets. fp32 training on these GPUs runs its
# convolutions in TF32 (PyTorch's default for cuDNN), so fp32 is measured against the TF32 peak.
_GPU_PEAKS: dict[str, dict[str, tuple[float, str]]] = {
    "NVIDIA H200": {
        "fp16": (989.4e12, "NVIDIA H200 datasheet, dense FP16 tensor core (SXM)"),
        "bf16": (989.4e12, "NVIDIA H200 datasheet, dense BF16 tensor core (SXM)"),
        "fp32": (494.7e12, "NVIDIA H200 datasheet, dense TF32 tensor core (SXM); PyTorch convolutions use TF32"),
    },
    "NVIDIA H100 80GB HBM3": {
        "fp16": (989.4e12, "NVIDIA H100 datasheet, dense FP16 tensor core (SXM)"),
        "bf16": (989.4e12, "NVIDIA H100 datasheet, dense BF16 tensor core (SXM)"),
        "fp32": (494.7e12, "NVIDIA H100 datasheet, dense TF32 tensor core (SXM); PyTorch convolutions use TF32"),
    },
    "NVIDIA A100-SXM4-40GB": {
        "fp16": (312e12, "NVIDIA A100 datasheet, dense FP16 tensor core"),
        "bf16": (312e12, "NVIDIA A100 datasheet, dense BF16 tensor core"),
        "fp32": (156e12, "NVIDIA A100 datasheet, dense TF32 tensor core; PyTorch convolutions use TF32"),
    },
}
_GPU_PEAKS["NVIDIA A100-SXM4-80GB"] = _GPU_PEAKS["NVIDIA A100-SXM4-40GB"]


def model_flops(spec: UNetSpec, crop: int) -> dict[str, float]:
    """FLOPs of one sample: forward, and forward + backward (a training step without the optimizer)."""
    with torch.device("meta"):
        net = spec.build()
        with FlopCounterMode(display=False) as counter:
            net(torch.empty(1, spec.in_channels, crop, crop, crop))
        forward = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            net(torch.empty(1, spec.in_channels, crop, crop, crop)).sum().backward()
        training = counter.get_total_flops()
    return {"forward_flops_per_sample": float(forward), "train_flops_per_sample": float(training)}


def _cpu_peak(precision: str) -> tuple[float | None, str]:
    """An estimate: cores x clock x FLOP per cycle from the vector units the CPU reports."""
    info = cpu_info()
    mhz, flags = info.mhz, info.flags
    if not mhz:
        return None, "unknown CPU clock"
    cores = len(os.sched_getaffinity(0))
    per_cycle, unit = (64, "AVX-512, 2 FMA units") if "avx512f" in flags else (32, "AVX2, 2 FMA units")
    peak = cores * mhz[0] * 1e6 * per_cycle
    source = f"estimate: {cores} cores x {mhz[0]:.0f} MHz x {per_cycle} fp32 FLOP/cycle ({unit})"
    if precision == "bf16":
        if "avx512_bf16" not in flags:
            return None, "no bf16 vector instructions reported"
        return 2 * peak, source + " x 2 for bf16 dot products (AVX512_BF16)"
    return (peak, source) if precision == "fp32" else (None, f"no {precision} peak for CPUs")


def peak_flops(device_name: str, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, where that number comes from) for a device as ``bench.env`` names it."""
    if device_name == "cpu":
        return _cpu_peak(precision)
    entry = _GPU_PEAKS.get(device_name, {}).get(precision)
    return entry if entry else (None, f"no peak known for {device_name} in {precision}: add it to bench/flops.py")


def utilization(
    samples_per_s: float, flops: dict[str, float], device_name: str, *, precision: str, devices: int = 1
) -> dict[str, Any]:
    """Achieved TFLOP/s of ``samples_per_s`` training samples, and MFU against ``devices`` x the device's peak.

    ``devices``: the GPUs of the job, or the nodes for CPUs (a CPU's peak counts all the cores its ranks share).
    """
    achieved = samples_per_s * flops["train_flops_per_sample"]
    peak, source = peak_flops(device_name, precision)
    if peak is not None:
        peak *= devices
    return {
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": None if peak is None else peak / 1e12,
        "peak_source": source,
        "mfu": None if peak is None else achieved / peak,
    }
