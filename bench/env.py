"""What every benchmark record carries about where and with what it ran."""

from __future__ import annotations

import os
import platform
import socket
import time
from importlib import metadata
from typing import Any

import torch

from trainer.provenance import REPO as REPO  # re-exported for the benchmarks
from trainer.provenance import git_commit


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "host": socket.gethostname(),
        "device": gpu or "cpu",
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "dali": _version("nvidia-dali-cuda120") or _version("nvidia-dali-cuda130"),
        "deepspeed": _version("deepspeed"),
        "python": platform.python_version(),
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
