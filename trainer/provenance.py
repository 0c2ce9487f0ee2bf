"""Which code, and which machine, produced a result: recorded in every run directory and benchmark record; and,
gathered from every rank at the end of a run, where each ran and whether their weights agree."""

from __future__ import annotations

import functools
import logging
import platform
import socket
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from common.tensors import tensor_digest

log = logging.getLogger(__name__)

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


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def software() -> dict[str, Any]:
    """The versions that decide what a run computes and how fast: torch with the CUDA and cuDNN it runs (None
    without), DeepSpeed, DALI (either CUDA build) and Python."""
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "deepspeed": _version("deepspeed"),
        "dali": _version("nvidia-dali-cuda120") or _version("nvidia-dali-cuda130"),
        "python": platform.python_version(),
    }


def _gathered(mine: Any, world_size: int) -> list[Any]:
    gathered: list[Any] = [None] * world_size
    torch_dist.all_gather_object(gathered, mine)
    return gathered


def rank_hosts(world_size: int) -> list[str]:
    """The host each rank runs on, gathered from all (a collective)."""
    return _gathered(socket.gethostname(), world_size)


def rank_facts(module: torch.nn.Module, first_batch_digest: str | None, world_size: int) -> dict[str, Any]:
    """Per rank, gathered from all (a collective): the host it ran on, the digest of its weights (equal when the
    ranks are in sync, an error line where they differ) and of the first batch it drew (different crops per rank)."""
    gathered = _gathered((socket.gethostname(), tensor_digest(module.parameters()), first_batch_digest), world_size)
    facts = {
        "rank_hosts": [g[0] for g in gathered],
        "rank_weight_digests": [g[1] for g in gathered],
        "rank_first_batch_digests": [g[2] for g in gathered],
    }
    if len(set(facts["rank_weight_digests"])) > 1:
        log.error("the ranks' weights differ at the end of training: %s", facts["rank_weight_digests"])
    return facts


# Where a copy of the project made for a machine without its repository keeps the commit it was copied from
# (``python -m trainer.provenance``, run in the repository before copying; git ignores the file).
COMMIT_FILE = REPO / "COMMIT"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def git_commit() -> str:
    """The project's commit: HEAD of its own repository, marked +dirty when code differs from it (documentation and
    results do not count); in a copy without its repository, the commit written into COMMIT when the copy was made;
    "unknown" otherwise. A repository around a copy (another checkout it was copied into) is not the project's."""
    try:
        if Path(_git("rev-parse", "--show-toplevel")).resolve() == REPO.resolve():
            dirty = _git("status", "--porcelain", "--", ".", ":!*.md", ":!bench/results", ":!COMMIT")
            return _git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        return COMMIT_FILE.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    # Before copying the project to a machine without its repository: the copy then names the commit it came from.
    commit = git_commit()
    COMMIT_FILE.write_text(commit + "\n")
    print(f"{COMMIT_FILE.name}: {commit}")
