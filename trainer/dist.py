"""This rank's device and torch.distributed through DeepSpeed (NCCL on GPUs, gloo on CPUs): the rendezvous is
``common.launch``'s, DeepSpeed's CPU communication op is built, announced and its shared memory released here.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator

from common.launch import DistEnv, DistError, first_host, is_main_process, start_process_group, tasks_on_node
from pipeline.shared import PREFIX as SHARED_PREFIX
from pipeline.shared import SHM, reclaim_stale
from trainer.op_builds import jit_built, settle_build_lock, use_environment_ninja
from trainer.provenance import cpu_info

log = logging.getLogger(__name__)

__all__ = ["DistEnv", "first_host", "is_main_process", "tasks_on_node", "init_distributed", "gpu_index", "Device"]


@dataclass(frozen=True)
class Device:
    type: str
    """'cuda' or 'cpu', as DeepSpeed's accelerator names it."""
    index: int | None
    """The GPU this rank uses, None on CPU."""


def gpu_index(
    local_rank: int, local_world_size: int, visible_gpus: int, *, environ: Mapping[str, str], srun_tasks: bool
) -> int:
    """The GPU of a rank: its local rank, or 0 where srun gives each of its tasks a GPU of its own
    (``--gpus-per-task``: SLURM_GPUS_PER_TASK set, CUDA_VISIBLE_DEVICES naming one GPU).

    Two ranks on one GPU would fail mid-run in NCCL ("Duplicate GPU detected"): a DistError here instead.
    """
    if visible_gpus == 1 and local_world_size == 1:
        return 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    one_each = srun_tasks and "SLURM_GPUS_PER_TASK" in environ
    if visible_gpus == 1 and one_each and visible is not None and len(visible.split(",")) == 1:
        return 0
    if local_world_size > visible_gpus:
        shared = f" (CUDA_VISIBLE_DEVICES={visible} for every rank)" if visible is not None and not one_each else ""
        raise DistError(
            f"{local_world_size} ranks on this node but {visible_gpus} GPU(s) visible to each{shared}: run one rank "
            "per GPU (deepspeed --num_gpus, torchrun --nproc_per_node, srun --ntasks-per-node, or srun "
            "--gpus-per-task 1, which gives each task a GPU of its own)"
        )
    return local_rank


_CPU_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME, loaded when torch.distributed starts


def announce_cpu_comm_build() -> None:
    """On CPUs DeepSpeed compiles its shared-memory communication op the first time a process starts, silently for
    about 40 s, and caches it; say so before that silence."""
    built, build = jit_built(_CPU_COMM_OP)
    if not built:
        log.info("building DeepSpeed's CPU communication op, once (about 40 s; cached in %s)", build)


def _cpu_comm_buffers(uid: int) -> str:
    """The name prefix of DeepSpeed's CPU all-reduce segments in /dev/shm (its shm.cpp: one per rank)."""
    return f"deepspeed_allreduce_buffer_{uid}_"


def reclaim_shared_memory() -> None:
    """Unlink the segments in /dev/shm that killed runs of this user left (the project's shared copies, DeepSpeed's
    CPU all-reduce buffers) and that no process maps any more, in one line."""
    stale = reclaim_stale([SHARED_PREFIX, _cpu_comm_buffers(os.getuid())])
    if stale:
        log.warning(
            "reclaimed %d shared-memory segment(s) in %s that ended runs left behind (%s)",
            len(stale),
            SHM,
            ", ".join(p.name for p in stale[:4]) + (", ..." if len(stale) > 4 else ""),
        )


def _release_cpu_comm_buffers(dist: DistEnv) -> None:
    """DeepSpeed's CPU all-reduce maps a segment of /dev/shm per rank and leaves it there when the run ends. Each rank
    maps all of them while DeepSpeed starts, so once every rank is past that their names go: the memory goes with
    the last rank that maps it, however the run ends."""
    torch_dist.barrier()
    if dist.local_rank == 0:
        prefix = f"{_cpu_comm_buffers(os.getuid())}{dist.master_addr}_{dist.master_port}_"
        for path in SHM.glob(f"{prefix}*"):
            path.unlink(missing_ok=True)


def init_distributed(dist: DistEnv, timeout_s: float) -> Device:
    """Start torch.distributed (NCCL on GPUs, gloo on CPUs) and pick this rank's device.

    ``timeout_s`` bounds how long the rendezvous waits for the ranks, and a collective for a rank that is gone (its
    launcher should end the job first; this is the backstop). A rendezvous or backend that fails is one DistError.
    """
    device_type = get_accelerator().device_name()
    dist.export()
    index = None
    if device_type == "cuda":
        index = gpu_index(
            dist.local_rank,
            dist.local_world_size,
            torch.cuda.device_count(),
            environ=os.environ,
            srun_tasks=dist.source == "slurm",
        )
        torch.cuda.set_device(index)
        os.environ["LOCAL_RANK"] = str(index)  # DeepSpeed takes its device from LOCAL_RANK
    else:
        use_environment_ninja()
        if dist.is_main:
            announce_cpu_comm_build()
        settle_build_lock(_CPU_COMM_OP, clears=dist.local_rank == 0)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if dist.local_rank == 0:
        reclaim_shared_memory()
    start_process_group(dist, backend, index, timeout_s=timeout_s)
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))  # wraps the group
    if device_type == "cpu":
        _release_cpu_comm_buffers(dist)
    started = {"launcher": "a launcher's variables", "slurm": "srun's variables", "single": "no launcher"}[dist.source]
    log.info(
        "rank %d of %d on %s (local rank %d of %d on this node), from %s; rendezvous %s:%d",
        dist.rank,
        dist.world_size,
        socket.gethostname(),
        dist.local_rank,
        dist.local_world_size,
        started,
        dist.master_addr,
        dist.master_port,
    )
    return Device(device_type, index)


def device_name(device: Device) -> str:
    """The GPU's name, or the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index)
    model = cpu_info().model
    return f"cpu: {model}" if model else "cpu"


def on_any_rank(device: torch.device, *, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: one small reduction, and a host sync."""
    value = torch.tensor([float(flag)], device=device)
    torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MAX)
    return bool(value.item())
