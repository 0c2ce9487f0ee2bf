"""Which code, and which machine, produced a result: recorded in every run directory and benchmark record."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says about this machine's CPU (empty where it cannot be read)."""

    model: str | None
    mhz: tuple[float, ...]
    flags: frozenset[str]


@functools.cache
def cpu_info() -> CpuInfo:
    """/proc/cpuinfo, read once per process."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return CpuInfo(None, (), frozenset())
    fields = [(key.strip(), value.strip()) for key, _, value in (line.partition(":") for line in lines)]
    model = next((value for key, value in fields if key == "model name"), None)
    mhz = tuple(float(value) for key, value in fields if key == "cpu MHz")
    flags = next((frozenset(value.split()) for key, value in fields if key == "flags"), frozenset())
    return CpuInfo(model, mhz, flags)


def git_commit() -> str | None:
    """HEAD, marked +dirty when code differs from it (documentation and results do not count)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":!*.md", ":!bench/results"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if status else "")
    except (OSError, subprocess.CalledProcessError):
        return None
