"""Where this process stands in the job, and the rendezvous of its ranks: rank, local rank, world size and address.

One place reads the three ways a process can be started: by a launcher (``deepspeed``, ``torchrun``: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), by ``srun`` (Slurm's variables, mapped here, as DeepSpeed reads
only the launchers'), or by nothing (a single process); contradictions are errors. ``start_process_group`` holds the
rendezvous (a fault is one DistError) and starts torch.distributed: the trainer, the prediction, any command.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

log = logging.getLogger(__name__)


class DistError(ValueError):
    """Contradictory or incomplete distributed settings, or a rendezvous that failed; the message names the
    variables and what to change."""


_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'nid[001-004,010],gpu7' -> 'nid001'."""
    first, depth = "", 0
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(ch, 0)
        first += ch
    # Each bracket group contributes its first entry: 'rack[1-2]-n[03,05]' -> 'rack1-n03'.
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from Slurm's compressed count list: '4(x2),3' -> [4, 4, 3]."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise DistError(f"cannot read SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise DistError(f"SLURM_NODEID={node_id} is not in SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def _ints(environ: Mapping[str, str], names: tuple[str, ...]) -> dict[str, int]:
    try:
        return {v: int(environ[v]) for v in names}
    except ValueError:
        raise DistError(
            f"{', '.join(names)} must be integers, got " + ", ".join(f"{v}={environ[v]!r}" for v in names)
        ) from None


def is_main_process() -> bool:
    """Whether this process is the job's rank 0: the process group's answer once it is up, before that the RANK
    that ``DistEnv.export`` set (a process started alone is rank 0)."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str = "single"
    """Who started the process: 'launcher', 'slurm' or 'single'."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        launcher = [v for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if v in environ]
        in_step = "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ
        if launcher:
            env = cls._from_launcher(environ, launcher)
            if in_step:
                cls._check_against_slurm(env, environ)
        elif in_step:
            env = cls._from_slurm(environ)
        else:
            if int(environ.get("SLURM_NTASKS", "1")) > 1:
                log.warning(
                    "in a Slurm allocation of %s tasks but not started by srun or a launcher: training on one process",
                    environ["SLURM_NTASKS"],
                )
            return cls(
                rank=0,
                local_rank=0,
                world_size=1,
                local_world_size=1,
                master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                master_port=_free_port(),
            )
        if not 0 < env.master_port < 2**16:
            raise DistError(f"the rendezvous port {env.master_port} (MASTER_PORT) is not a port: choose one in 1-65535")
        if not 0 <= env.rank < env.world_size or not 0 <= env.local_rank < env.local_world_size:
            raise DistError(
                f"inconsistent ranks from the {env.source}: rank {env.rank}, local rank {env.local_rank}, "
                f"world size {env.world_size}, local world size {env.local_world_size}"
            )
        return env

    @classmethod
    def _from_launcher(cls, environ: Mapping[str, str], present: list[str]) -> DistEnv:
        missing = [v for v in _LAUNCHER_VARS if v not in environ]
        if missing:
            raise DistError(f"launcher variables incomplete: {', '.join(present)} set but {', '.join(missing)} missing")
        values = _ints(environ, ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"))
        # torchrun names it LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
        local_world = int(environ.get("LOCAL_WORLD_SIZE", environ.get("LOCAL_SIZE", values["WORLD_SIZE"])))
        return cls(
            rank=values["RANK"],
            local_rank=values["LOCAL_RANK"],
            world_size=values["WORLD_SIZE"],
            local_world_size=local_world,
            master_addr=environ["MASTER_ADDR"],
            master_port=values["MASTER_PORT"],
            source="launcher",
        )

    @classmethod
    def _from_slurm(cls, environ: Mapping[str, str]) -> DistEnv:
        missing = [v for v in _SLURM_VARS if v not in environ]
        nodelist = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST"))
        if nodelist is None:
            missing.append("SLURM_STEP_NODELIST")
        if missing:
            raise DistError(f"Slurm step variables incomplete: {', '.join(missing)} missing")
        values = _ints(environ, ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID"))
        if "MASTER_PORT" in environ:
            port = _ints(environ, ("MASTER_PORT",))["MASTER_PORT"]
        else:  # the same on every task of the step, and different for other jobs and steps
            job, step = _ints(environ, ("SLURM_JOB_ID", "SLURM_STEP_ID")).values()
            port = 20000 + (job * 16 + step) % 20000
        return cls(
            rank=values["SLURM_PROCID"],
            local_rank=values["SLURM_LOCALID"],
            world_size=values["SLURM_NTASKS"],
            local_world_size=tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], values["SLURM_NODEID"]),
            master_addr=environ.get("MASTER_ADDR", first_host(nodelist)),
            master_port=port,
            source="slurm",
        )

    @staticmethod
    def _check_against_slurm(env: DistEnv, environ: Mapping[str, str]) -> None:
        """A launcher inside an srun step is fine (it starts the ranks itself), unless the step's tasks
        are the ranks and the two disagree: typically RANK exported in the batch script for all tasks."""
        tasks = int(environ.get("SLURM_NTASKS", "1"))
        if tasks > 1 and tasks == env.world_size and str(env.rank) != environ["SLURM_PROCID"]:
            raise DistError(
                f"RANK={env.rank} contradicts SLURM_PROCID={environ['SLURM_PROCID']} in a step of "
                f"{tasks} tasks = WORLD_SIZE: unset RANK/LOCAL_RANK/WORLD_SIZE when starting ranks with srun"
            )

    def export(self) -> None:
        """Put the rendezvous in the environment, where torch.distributed's env:// init reads it."""
        os.environ.update(
            RANK=str(self.rank),
            LOCAL_RANK=str(self.local_rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def _resolve(dist: DistEnv) -> None:
    """A rendezvous host that cannot be resolved is one line at once, not a connection retried until the timeout."""
    try:
        socket.getaddrinfo(dist.master_addr, dist.master_port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        why = err.strerror if isinstance(err, socket.gaierror) else str(err)
        raise DistError(
            f"rank {dist.rank}: the rendezvous host {dist.master_addr} (MASTER_ADDR) cannot be resolved ({why}): "
            "set MASTER_ADDR to a name or address of rank 0's host that every node can resolve"
        ) from None


def _rendezvous_fault(err: Exception, dist: DistEnv, timeout_s: float) -> DistError:
    """torch's error at the rendezvous, as one line saying what failed and what to change."""
    text = " ".join(str(err).split())
    where = f"{dist.master_addr}:{dist.master_port}"
    bound = f"{timeout_s:g} s (dist_timeout_s, 600 s by default)"
    if "EADDRINUSE" in text:
        return DistError(
            f"rank {dist.rank}: the rendezvous port {dist.master_port} (MASTER_PORT) is taken on this host, by another "
            "job or a second process started as rank 0: set MASTER_PORT to a free port (the launchers' --master_port)"
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        return DistError(
            f"rank 0: only {joined[1]} of {joined[2]} ranks reached the rendezvous {where} within {bound}: start every "
            "rank, each with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, where rank 0's host can be reached"
        )
    if "timed out" in text and "connect" in text or "Connection was likely closed" in text:
        return DistError(
            f"rank {dist.rank}: could not reach the rendezvous {where} within {bound}: rank 0 is not running there, "
            "has ended, or the network between the hosts blocks the port; check MASTER_ADDR and MASTER_PORT"
        )
    return DistError(f"rank {dist.rank}: the rendezvous at {where} failed: {text[:300]}")


def _roll_call(store: torch_dist.Store, dist: DistEnv, timeout_s: float) -> None:
    """Every rank answers once, before the process group forms: a WORLD_SIZE that differs from rank 0's, a RANK
    given to two processes, or a rank that never comes is one line, where torch would hang or go on with a broken
    group. The second process started with a RANK stops; the ranks of the group go on."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives its restarts
    prefix, me = f"roll_call/{attempt}", f"{socket.gethostname()}:{os.getpid()}"
    fault = f"{prefix}/fault"
    if dist.is_main:
        store.set(f"{prefix}/world_size", str(dist.world_size))
    world = int(store.get(f"{prefix}/world_size"))
    if world != dist.world_size:
        store.set(fault, f"rank {dist.rank} ({me}) was started with WORLD_SIZE={dist.world_size}")
        raise DistError(
            f"rank {dist.rank}: WORLD_SIZE={dist.world_size} here but {world} at rank 0: start every rank with the "
            "same WORLD_SIZE"
        )
    first = store.compare_set(f"{prefix}/rank{dist.rank}", "", me).decode()
    if first != me:
        raise DistError(
            f"rank {dist.rank} was started twice (process {first} first, then this one, {me}): this one stops; give "
            "each process a RANK of its own"
        )
    keys = [f"{prefix}/rank{r}" for r in range(dist.world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if store.check([fault]):
            raise DistError(
                f"rank {dist.rank}: {store.get(fault).decode()}, not {dist.world_size}: start every rank "
                "with the same WORLD_SIZE"
            )
        if time.monotonic() > deadline:
            missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
            raise DistError(
                f"rank {dist.rank}: rank(s) {', '.join(missing[:16])} did not reach the rendezvous within "
                f"{timeout_s:g} s (dist_timeout_s, 600 s by default): start every rank, each with its own RANK"
            )
        time.sleep(0.05)


def start_process_group(dist: DistEnv, backend: str, gpu: int | None, *, timeout_s: float) -> None:
    """The rendezvous (rank 0 serves it, or torchrun's agent does), the roll call, then the process group: bound to
    this rank's GPU as DeepSpeed binds it, so that NCCL starts here rather than at the first collective."""
    _resolve(dist)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = torch_dist.TCPStore(
            dist.master_addr,
            dist.master_port,
            dist.world_size,
            is_master=dist.is_main and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
            timeout=timeout,
            multi_tenant=True,
        )
        _roll_call(store, dist, timeout_s)
    except (torch_dist.DistError, RuntimeError) as err:
        raise _rendezvous_fault(err, dist, timeout_s) from None
    try:
        torch_dist.init_process_group(
            backend,
            store=store,
            rank=dist.rank,
            world_size=dist.world_size,
            timeout=timeout,
            device_id=torch.device("cuda", gpu) if gpu is not None and dist.world_size > 1 else None,
        )
    except (torch_dist.DistError, RuntimeError) as err:
        text = " ".join(str(err).split())
        missing = re.search(r"Unable to find address for: (\S+)", text)
        if missing:
            variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
            raise DistError(
                f"rank {dist.rank}: the {backend} backend could not start: this host has no network interface "
                f"{missing[1]} ({variable}={os.environ.get(variable, '')}): name one it has (ip -br addr), or unset it"
            ) from None
        raise DistError(f"rank {dist.rank}: the {backend} backend could not start: {text[:300]}") from None
