"""One writer at a time: a hold on a directory or an output file, kept for as long as the process that took it lives.

Two mechanisms together, because a cluster's shared file system may honour either, both or neither across nodes:

- ``flock`` on a lock file, which the kernel releases when the holder ends however it ends (SIGKILL included);
- a record of the holder (host, machine, process, since when, Slurm job) that the holder renews while it lives,
  a lease: a start on another machine that finds the record judges it by whether it is still renewed.

A record left by a holder that died is taken over: at once on the same machine (its process is gone), at once by a
requeue of the same Slurm job, and after one lease without renewal from elsewhere. docs/troubleshooting.md tells
the whole story.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LEASE_ENV = "HOLD_LEASE_S"  # how long a record stays valid without renewal (default LEASE_S)
FLOCK_ENV = "HOLD_FLOCK"  # "off": leave flock out, where a file system's flock misbehaves (hangs, or lies)
LEASE_S = 60.0
RENEWALS_PER_LEASE = 6
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class HeldError(ValueError):
    """What a process wanted is held by another one; the message names the holder and what to do."""


def _machine(host: str) -> str:
    """This kernel and process namespace, whatever the host names say: processes with the same machine see each
    other's pids."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pids = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = pids = ""
    return f"{host}/{boot}/{pids}"


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), which tells it from a later process given its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _command() -> str:
    """What this process runs: a module's name (``model.predict``), or the script's (``ds_train.py``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name not in ("__main__", ""):
        return spec.name.removesuffix(".__main__")
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds, as its record says."""

    host: str
    machine: str
    pid: int
    start_ticks: int | None
    command: str
    since: str
    job: str  # the Slurm job id, or ""
    restart: int  # Slurm's restart count of that job
    token: str
    lease_s: float
    renewals: int = 0

    @classmethod
    def me(cls, lease_s: float) -> Holder:
        host = socket.gethostname()
        return cls(
            host=host,
            machine=_machine(host),
            pid=os.getpid(),
            start_ticks=_start_ticks(os.getpid()),
            command=_command(),
            since=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            job=os.environ.get("SLURM_JOB_ID", ""),
            restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            token=uuid.uuid4().hex,
            lease_s=lease_s,
        )

    def describe(self) -> str:
        job = f", Slurm job {self.job}" if self.job else ""
        return f"process {self.pid} ({self.command}) on {self.host} since {self.since}{job}"

    def alive_here(self) -> bool:
        """On this machine: whether the holder's process still runs (the same process, not a later one)."""
        ticks = _start_ticks(self.pid)
        if ticks is not None:
            return self.start_ticks is None or ticks == self.start_ticks
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _read(path: Path) -> Holder | None:
    """The record at ``path``, or None where there is none (or it is being replaced)."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write(path: Path, holder: Holder) -> None:
    with path.open("w") as f:
        f.write(json.dumps(asdict(holder)))
        f.flush()
        os.fsync(f.fileno())


def _lease_s() -> float:
    raw = os.environ.get(LEASE_ENV, str(LEASE_S))
    try:
        lease = float(raw)
    except ValueError:
        lease = -1.0
    if not lease > 0:
        raise HeldError(f"{LEASE_ENV}={raw!r} must be a positive number of seconds")
    return lease


class Hold:
    """A hold taken by this process on ``target`` (see ``hold_directory`` and ``hold_file``)."""

    def __init__(self, target: Path, lock: Path, record: Path, *, what: str) -> None:
        self.target, self.lock, self.record, self.what = target, lock, record, what
        self.holder = Holder.me(_lease_s())
        self._fd: int | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False  # set when another process took over the record (this one stopped renewing too long)

    # -- taking ---------------------------------------------------------------------------------------------------
    def take(self, wait_s: float = 0.0) -> Hold:
        """Hold ``target``, or HeldError naming the holder. ``wait_s`` > 0 waits that long for a holder to finish."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._take_once()
                break
            except HeldError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        self._renewer = threading.Thread(target=self._renew, name=f"hold {self.target}", daemon=True)
        self._renewer.start()
        return self

    def _take_once(self) -> None:
        if os.environ.get(FLOCK_ENV, "on") != "off":
            self._flock()
        try:
            while not self._create_record():
                self._judge(_read(self.record))
        except BaseException:
            self._unlock(remove=False)
            raise

    def _flock(self) -> None:
        """flock the lock file: refused at once where a live holder has it (on any machine where flock works
        across them); a file system without flock leaves the record alone to decide."""
        while True:
            fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise HeldError(self._refusal(_read(self.record))) from None
                if err.errno in _NO_FLOCK:
                    log.debug("%s: no flock on this file system (%s); the lease alone decides", self.lock, err)
                    return
                raise
            try:  # the file locked is still the one at the path (a holder that released may have removed it)
                if os.fstat(fd).st_ino == os.stat(self.lock).st_ino:
                    self._fd = fd
                    return
            except FileNotFoundError:
                pass
            os.close(fd)

    def _create_record(self) -> bool:
        """Write this process's record where there is none, atomically even on NFS (link fails if it exists)."""
        tmp = self.record.with_name(f"{self.record.name}.{self.holder.token}")
        _write(tmp, self.holder)
        try:
            os.link(tmp, self.record)
            return True
        except FileExistsError:
            return os.stat(tmp).st_nlink == 2  # NFS may report a retried link that did succeed as existing
        finally:
            tmp.unlink(missing_ok=True)

    def _judge(self, holder: Holder | None) -> None:
        """The record of another process: taken over where its holder is gone, else HeldError."""
        if holder is None:  # released or replaced meanwhile: look again
            return
        why = self._stale_because(holder)
        if why is None:
            raise HeldError(self._refusal(holder))
        if self._set_aside(holder):
            log.warning("%s: took over the hold of %s: %s", self.target, holder.describe(), why)

    def _stale_because(self, holder: Holder) -> str | None:
        """Why ``holder``'s record no longer holds anything, or None where its holder lives."""
        me = self.holder
        if holder.machine == me.machine:
            return None if holder.alive_here() else "its process ended without releasing it"
        if holder.job and holder.job == me.job and holder.restart < me.restart:
            return f"Slurm restarted job {holder.job}"
        if self._renewed_within_lease(holder):
            return None
        return f"it was not renewed for {holder.lease_s:g} s"

    def _renewed_within_lease(self, holder: Holder) -> bool:
        """Watch a record from another machine for one lease: a live holder renews it several times within."""
        log.warning(
            "%s is held by %s, on another machine: waiting up to %g s (its lease) to see whether it is alive",
            self.target,
            holder.describe(),
            holder.lease_s,
        )
        deadline = time.monotonic() + holder.lease_s
        while time.monotonic() < deadline:
            time.sleep(min(0.5, holder.lease_s / (2 * RENEWALS_PER_LEASE)))
            now = _read(self.record)
            if now is None or now.token != holder.token:
                return False  # released or taken by someone else: look again
            if now.renewals != holder.renewals:
                return True
        return False

    def _set_aside(self, stale: Holder) -> bool:
        """Remove the stale record, unless another process replaced it meanwhile (then it is put back)."""
        aside = self.record.with_name(f"{self.record.name}.stale-{self.holder.token}")
        try:
            os.rename(self.record, aside)
        except FileNotFoundError:
            return False
        moved = _read(aside)
        if moved is not None and moved.token != stale.token:
            try:
                os.link(aside, self.record)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)
        return moved is not None and moved.token == stale.token

    def _refusal(self, holder: Holder | None) -> str:
        who = holder.describe() if holder else "another process"
        return f"{self.target} is held by {who}: {self.what}"

    # -- holding --------------------------------------------------------------------------------------------------
    def _renew(self) -> None:
        interval = self.holder.lease_s / RENEWALS_PER_LEASE
        renewals = 0
        while not self._stop.wait(interval):
            current = _read(self.record)
            if current is None or current.token != self.holder.token:
                self.lost = True
                who = current.describe() if current else "another process"
                log.error("%s: the hold was taken over by %s", self.target, who)
                return
            renewals += 1
            tmp = self.record.with_name(f"{self.record.name}.{self.holder.token}")
            try:
                _write(tmp, Holder(**{**asdict(self.holder), "renewals": renewals}))
                os.replace(tmp, self.record)
            except OSError as err:  # a file system gone for a moment: the next renewal may work
                log.warning("%s: could not renew the hold (%s)", self.target, err.strerror or err)

    def release(self) -> None:
        """Give the hold up: the record and the lock file go."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        current = _read(self.record)
        if current is not None and current.token == self.holder.token:
            self.record.unlink(missing_ok=True)
        self._unlock(remove=True)

    def _unlock(self, *, remove: bool) -> None:
        if self._fd is None:
            return
        if remove:
            self.lock.unlink(missing_ok=True)  # while locked: a start that opened it meanwhile sees it replaced
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_directory(path: Path, what: str, wait_s: float = 0.0) -> Hold:
    """Hold directory ``path`` (made if need be); ``what`` tells a refused process what to do instead."""
    path.mkdir(parents=True, exist_ok=True)
    return Hold(path, path / ".hold", path / ".hold.json", what=what).take(wait_s)


def hold_file(path: Path, what: str, wait_s: float = 0.0) -> Hold:
    """Hold output file ``path`` (whether or not it exists yet), by files beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Hold(path, path.with_name(f".{path.name}.hold"), path.with_name(f".{path.name}.hold.json"), what=what).take(
        wait_s
    )


def holder_of(path: Path) -> Holder | None:
    """The live holder of directory ``path``, judged as a start would judge it, without taking the hold."""
    peek = Hold(path, path / ".hold", path / ".hold.json", what="")
    if os.environ.get(FLOCK_ENV, "on") != "off" and peek.lock.exists():
        try:
            peek._flock()
        except HeldError:
            return _read(peek.record)
        peek._unlock(remove=False)
    record = _read(peek.record)
    return record if record is not None and peek._stale_because(record) is None else None
