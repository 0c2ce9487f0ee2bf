"""One copy per node: arrays in shared memory (``/dev/shm``) that the node's first rank fills and its other ranks map.

A segment is unlinked as soon as every rank of the node has mapped it, so its memory goes with the last process that
maps it, however the run ends; one left by a run killed while filling it is reclaimed at the next start on the node
(``reclaim_stale``). docs/data.md (At full scale) says why shared memory rather than a node-local file.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from common.files import size_text
from pipeline.volumes import DataError

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
PREFIX = "cosmo-emulator-"  # the segments of this project; ``reclaim_stale`` is told DeepSpeed's too


class SharedError(DataError):
    """A shared copy that could not be made; the message says why, on every rank."""


class Agreement(Protocol):
    def __call__(self, *, failed: bool) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class Node:
    """This process's place among the ranks of its node, and how the job's ranks agree.

    ``agree(failed=...)`` is a collective of every rank of the job: True on every rank where any rank passed True.
    ``key`` is the same on every rank and names this run's segments."""

    local_rank: int = 0
    local_ranks: int = 1
    agree: Agreement = field(default=lambda *, failed: failed)
    key: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:8]}")

    @property
    def first(self) -> bool:
        return self.local_rank == 0

    def on_first(self, make: Callable[[], None], what: str) -> None:
        """Run ``make`` on the node's first rank, the others waiting; where it fails on any node, its error is raised
        there and a SharedError naming ``what`` on every other rank."""
        failed: BaseException | None = None
        if self.first:
            try:
                make()
            except (OSError, ValueError, MemoryError) as err:
                failed = err
        if self.agree(failed=failed is not None):
            if failed is not None:
                raise failed
            raise SharedError(f"{what} failed on a node's first rank (its error line says why)")


def shared_array(node: Node, name: str, *, shape: tuple[int, ...], fill: Callable[[np.ndarray], None]) -> np.ndarray:
    """A float32 array of ``shape`` in shared memory: the node's first rank fills it (``fill(array)``, which should
    write into it in place), then every rank maps it read-only; the segment's name goes once all have mapped it."""
    nbytes = int(np.prod(shape)) * 4
    path = SHM / f"{PREFIX}{node.key}-{socket.gethostname()}-{name}"  # a host name: machines sharing one /dev/shm
    mapped: list[mmap.mmap] = []

    def create() -> None:
        free = os.statvfs(SHM)
        if nbytes > free.f_bavail * free.f_frsize:
            size = free.f_blocks * free.f_frsize
            raise OSError(
                f"{size_text(nbytes)} do not fit in {SHM} ({size_text(free.f_bavail * free.f_frsize)} free of "
                f"{size_text(size)}): use storage 'lazy', or enlarge {SHM}"
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # EEXIST: a name two runs share, never reused
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))  # the pages now, not a SIGBUS when /dev/shm fills up
            segment = mmap.mmap(fd, max(nbytes, 1))
        except OSError as err:
            if err.errno == errno.EFBIG:
                raise OSError(
                    f"the shared copy {path} ({size_text(nbytes)}) exceeds this process's file size limit "
                    "(ulimit -f): raise it, or use storage 'lazy'"
                ) from None
            raise
        finally:
            os.close(fd)
        mapped.append(segment)
        fill(np.ndarray(shape, dtype=np.float32, buffer=segment))

    try:
        node.on_first(create, f"the shared copy {path}")
        if not node.first:
            fd = os.open(path, os.O_RDONLY)
            try:
                mapped.append(mmap.mmap(fd, max(nbytes, 1), prot=mmap.PROT_READ))
            finally:
                os.close(fd)
        node.agree(failed=False)  # every rank of the node has mapped it
    finally:
        if node.first:
            path.unlink(missing_ok=True)
    array = np.ndarray(shape, dtype=np.float32, buffer=mapped[0])
    array.flags.writeable = False
    return array


def _mapped_paths() -> set[str]:
    """The files in SHM that some process of this machine maps or holds open (those this user may see)."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            with open(proc / "maps") as maps:
                held.update(line.split(maxsplit=5)[-1].strip() for line in maps if str(SHM) in line)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(str(SHM)):
                    held.add(target)
        except OSError:  # gone meanwhile, or another user's
            continue
    return held


def reclaim_stale(prefixes: Iterable[str]) -> list[Path]:
    """Unlink this user's segments in SHM named with one of ``prefixes`` that no process maps or holds open: what
    runs that were killed left behind. Returns them."""
    pattern = re.compile("|".join(re.escape(p) for p in prefixes))
    uid = os.getuid()
    candidates = [p for p in SHM.iterdir() if pattern.match(p.name) and _owned_by(p, uid)] if SHM.is_dir() else []
    if not candidates:
        return []
    held = _mapped_paths()
    stale = [p for p in candidates if str(p) not in held]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _owned_by(path: Path, uid: int) -> bool:
    try:
        return path.stat().st_uid == uid
    except OSError:
        return False
