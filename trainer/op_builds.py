"""DeepSpeed's ops that torch builds on first use (its CPU communication op, FusedAdam): the ninja that builds them
and the lock of a build.

torch builds such an op once into its extension cache, under a lock file that the building process holds open; any
other process waits for that file to go, with no time limit. A build stopped part way (a job cancelled or requeued
in its first minute, a killed test) leaves the file behind, and every later start on that cache then waits for ever,
silently. ``settle_build_lock`` stands before each such build: it says what it waits for, and takes away a lock that
no process on this machine holds once it is older than any build.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

# A build takes about 40 s on a 2-core CPU (the communication op) and a minute or two on a GPU machine (FusedAdam).
# A lock that no process here holds may be held by another machine sharing the cache (a home directory on a shared
# file system): such a lock is taken as left behind only once it is older than this.
STALE_LOCK_S = 300.0
_POLL_S = 1.0


def _ninja_dirs() -> list[str]:
    """Where the ninja of this interpreter's environment may be: beside the interpreter of a virtual environment
    (active or not; a system interpreter's directory would put all of /usr/bin before the user's modules), and the
    bin directory beside the ninja package (wheels installed with pip --target SITE put it there)."""
    dirs = [str(Path(sys.executable).parent)] if sys.prefix != sys.base_prefix else []
    spec = importlib.util.find_spec("ninja")
    if spec is not None and spec.origin is not None:
        dirs.append(str(Path(spec.origin).parent.parent / "bin"))
    return dirs


def use_environment_ninja() -> bool:
    """Put the environment's ninja first on PATH, where torch's JIT builds look; whether any ninja is there. One ninja
    for every start: two versions (a venv's and the system's) record a build's command differently in its log, so
    each rebuilt every op the other had built whenever a start found the other first."""
    found = [d for d in _ninja_dirs() if shutil.which("ninja", path=d)]
    if found:
        path = os.environ.get("PATH", "")
        if path.split(os.pathsep)[0] != found[0]:
            os.environ["PATH"] = found[0] + os.pathsep + path
    return bool(found) or shutil.which("ninja") is not None


def build_dir(name: str) -> Path:
    """Where torch builds and caches JIT extension ``name``."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def jit_built(name: str) -> tuple[bool, Path]:
    """Whether torch's JIT extension ``name`` (a DeepSpeed op) was built before, and where it is cached."""
    build = build_dir(name)
    return (build / f"{name}.so").exists(), build


def lock_holders(lock: Path) -> list[int]:
    """The processes on this machine that hold ``lock`` open (torch's builder keeps it open while it builds); those
    of other users cannot be seen."""
    target, holders = str(lock.resolve()), []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                holders.append(int(fd_dir.parent.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return holders


def _remove(lock: Path, inode: int) -> bool:
    """Remove ``lock`` if it is still the file ``inode``: another process clearing it meanwhile may have started a
    build of its own under a new lock."""
    try:
        if lock.stat().st_ino == inode:
            lock.unlink()
            return True
    except FileNotFoundError:
        pass
    return False


def settle_build_lock(name: str, *, clears: bool, stale_s: float = STALE_LOCK_S) -> None:
    """Return once op ``name`` has no build lock, saying what is waited for. The process that ``clears`` (one per
    machine: local rank 0) removes a lock that no process here holds and that is at least ``stale_s`` old, with a
    warning; the others wait for it to go."""
    lock = build_dir(name) / "lock"
    said = False
    while True:
        try:
            seen = lock.stat()
        except FileNotFoundError:
            return
        age_s, holders = time.time() - seen.st_mtime, lock_holders(lock)
        if clears and not holders and age_s >= stale_s:
            if _remove(lock, seen.st_ino):
                log.warning(
                    "removed %s, left %.0f s ago by a build of DeepSpeed's %s that was stopped part way (no process "
                    "here holds it): building it again",
                    lock,
                    age_s,
                    name,
                )
            continue
        if not said:
            held = f"held by process {', '.join(map(str, holders))}" if holders else "held by no process here"
            log.warning(
                "waiting for the build of DeepSpeed's %s to finish (lock %s, %.0f s old, %s)%s",
                name,
                lock,
                age_s,
                held,
                ""
                if holders
                else f"; a lock no process here holds is taken as left behind once {stale_s:.0f} s old, and removed",
            )
            said = True
        time.sleep(_POLL_S)
