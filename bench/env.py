"""What every benchmark record carries about where and with what it ran."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent


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


def git_commit() -> str | None:
    """HEAD, marked +dirty when code differs from it (documentation and results do not count)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":!*.md", ":!bench/results"],
            cwd=REPO, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("+dirty" if status else "")
    except (OSError, subprocess.CalledProcessError):
        return None


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
