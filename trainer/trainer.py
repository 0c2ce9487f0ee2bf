"""The training loop: a DeepSpeed engine fed by DALI, validated every epoch, checkpointed, resumable.

The micro-step itself is ``trainer.step.micro_step``, which the benchmarks and tests run too; ``evaluate`` is a
plain function for the same reason.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import deepspeed
import h5py
import numpy as np
import psutil
import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from model import UNet, unet_loss
from model.metrics import Normalization, compare
from model.tiling import predict_box
from pipeline.loaders import (
    LoaderSettings,
    batch_buffer_bytes,
    build_loader,
    check_memory,
    dali_installed,
    effective_storage,
    resolve_backend,
)
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.synthetic import ensure_boxes
from pipeline.volumes import DataError, VolumeFiles, VolumePair
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import Config
from trainer.dist import DistEnv
from trainer.engine import (
    TORCH_FUSED_ADAM,
    jit_built,
    load_ds_template,
    loss_scale,
    plan_batches,
    precision_name,
    resolve_ds_config,
    skip_single_rank_reduction,
    train_dtype,
)
from trainer.errors import ConfigError, DistError, NumericalError
from trainer.lr_schedule import ScaledCosineSchedule, peak_lr, warmup_applies
from trainer.preemption import StopRequest
from trainer.rundir import PROFILE, RunDir
from trainer.runlog import RunLog
from trainer.step import micro_step, phase

log = logging.getLogger(__name__)
PROFILE_STEPS = 3  # micro-steps a --profile trace records, after one skipped and one of warm-up


@torch.no_grad()
def evaluate(engine: Any, loader: Iterable[tuple[torch.Tensor, torch.Tensor]], lambda_rho: float) -> float:
    """Mean validation loss per sample over all ranks (one reduction of [sum, count])."""
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for inp, tar in loader:
        totals[0] += unet_loss(engine(inp), tar, lambda_rho) * inp.shape[0]
        totals[1] += inp.shape[0]
    engine.train()
    torch_dist.all_reduce(totals)
    return float(totals[0] / totals[1])


@dataclass(frozen=True)
class Device:
    type: str
    """'cuda' or 'cpu', as DeepSpeed's accelerator names it."""
    index: int | None
    """The GPU this rank uses, None on CPU."""


def gpu_index(
    local_rank: int, local_world_size: int, visible_gpus: int, environ: Mapping[str, str], srun_tasks: bool
) -> int:
    """The GPU of a rank: its local rank, or 0 where Slurm gives each task a GPU of its own: the ranks are srun's
    tasks (``srun_tasks``, not processes a launcher started inside one task) and srun ran with --gpus-per-task
    (SLURM_GPUS_PER_TASK set, CUDA_VISIBLE_DEVICES naming one GPU, a different one per task).

    Two ranks on one GPU (more ranks on a node than the GPUs they see, or several ranks that all see one and
    the same GPU, as with CUDA_VISIBLE_DEVICES=0 exported to every rank of a torchrun) fail mid-run in NCCL
    ("Duplicate GPU detected"): a clear error here instead.
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


def announce_cpu_comm_build() -> None:
    """On CPUs DeepSpeed compiles its shared-memory communication op the first time a process starts, silently for
    about 40 s, and caches it; say so before that silence."""
    built, build = jit_built("deepspeed_shm_comm")  # DeepSpeed's ShareMemCommBuilder.NAME
    if not built:
        log.info("building DeepSpeed's CPU communication op, once (about 40 s; cached in %s)", build)


def init_distributed(dist: DistEnv, timeout_s: float) -> Device:
    """Start torch.distributed (NCCL on GPUs, gloo on CPUs) and pick this rank's device.

    ``timeout_s`` bounds how long a collective waits for a rank that is gone (its launcher should
    end the job first; this is the backstop).
    """
    device_type = get_accelerator().device_name()
    dist.export()
    index = None
    if device_type == "cuda":
        index = gpu_index(
            dist.local_rank,
            dist.local_world_size,
            torch.cuda.device_count(),
            os.environ,
            srun_tasks=dist.source == "slurm",
        )
        torch.cuda.set_device(index)
        os.environ["LOCAL_RANK"] = str(index)  # DeepSpeed takes its device from LOCAL_RANK
    elif dist.is_main:
        announce_cpu_comm_build()
    deepspeed.init_distributed(
        dist_backend="nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
    )
    started = {"launcher": "a launcher's variables", "slurm": "srun's variables", "single": "no launcher"}[dist.source]
    log.info(
        "rank %d of %d (local rank %d of %d on this node), from %s",
        dist.rank,
        dist.world_size,
        dist.local_rank,
        dist.local_world_size,
        started,
    )
    return Device(device_type, index)


def unused_data_keys(cfg: Config, storage: str, backend: str, device_type: str) -> list[str]:
    """Keys set away from their defaults that the effective ``storage`` mode and ``backend`` do not use: the CPU
    threads cut nothing when the GPU cuts the crops (DALI still prefetches batches there, the torch backend does
    not), only volumes on the GPU have a dtype of their own, and only DALI's numpy reader on a GPU reads through
    GPUDirect Storage."""
    if storage == "device":
        unused = ["num_data_workers"] + (["data_prefetch"] if backend == "torch" else [])
    else:
        unused = ["device_storage_dtype"]
    if not (storage == "lazy" and cfg.data_format == "npy" and backend == "dali" and device_type == "cuda"):
        unused.append("gpu_direct_storage")
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    return [key for key in unused if getattr(cfg, key) != defaults[key]]


def prepare_data(cfg: Config, dist: DistEnv) -> None:
    """Generate the synthetic boxes the config asks for, once per node, before anyone reads them."""
    if cfg.synthetic is not None and dist.local_rank == 0:
        for which, path in ensure_boxes(cfg.synthetic, cfg.train_path, cfg.val_path):
            log.info("generated synthetic %s box %s", which, path)
    torch_dist.barrier()


def volume_files(cfg: Config, split: str) -> VolumeFiles:
    """Where the config says the ``split`` ('train' or 'val') volumes are."""
    if cfg.data_format == "hdf5":
        return VolumeFiles.hdf5(cfg.train_path if split == "train" else cfg.val_path)
    if split == "train":
        return VolumeFiles.npy(cfg.train_path_npy_data, cfg.train_path_npy_label, cfg.npy_layout)
    return VolumeFiles.npy(cfg.val_path_npy_data, cfg.val_path_npy_label, cfg.npy_layout)


def validation_share(num_samples: int, batch: int, last_batch: str, rank: int, world_size: int) -> tuple[int, int]:
    """(first global index, count) of the validation samples that ``rank`` evaluates.

    ``partial``: all samples, spread as evenly as the ranks allow (the last batch may be smaller);
    ``drop``: only what fills whole batches on every rank.
    """
    if last_batch == "drop":
        count = num_samples // world_size // batch * batch
        return rank * count, count
    base, extra = divmod(num_samples, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _device_name(device: Device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


@dataclass
class Interval:
    """Optimizer steps and losses since the last log point; losses stay on the device until then."""

    start: float
    steps: int = 0
    loss_sum: torch.Tensor | None = None
    micro_steps: int = 0
    data_wait_s: float = 0.0

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        self.micro_steps += 1


class Trainer:
    def __init__(
        self,
        cfg: Config,
        name: str,
        dist: DistEnv,
        device: Device,
        run: RunDir,
        resume: bool,
        stop_after_epoch: int | None = None,
        stop: StopRequest | None = None,
        profile: bool = False,
    ) -> None:
        self.cfg, self.name, self.dist, self.device, self.run = cfg, name, dist, device, run
        self.run_dir = run_dir = run.path
        self.profile = profile
        self.stop_after_epoch = stop_after_epoch
        self.stop = stop
        self.storage = effective_storage(cfg.storage, device.type)
        self.backend = resolve_backend(cfg.backend, device.type)
        if cfg.backend == "auto":
            log.info("backend: %s (auto, on a %s)", self.backend, "GPU" if device.type == "cuda" else "CPU")
        if self.backend == "dali" and not dali_installed():
            raise ConfigError(
                "backend: dali needs NVIDIA DALI, not installed here (requirements.txt); or set backend: torch"
            )
        if device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads or max(1, len(os.sched_getaffinity(0)) // dist.local_world_size))
            if cfg.cudnn_benchmark:
                log.warning("cudnn_benchmark has no effect without a GPU")
        else:
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark is not False
            if cfg.cpu_threads:
                log.warning("cpu_threads has no effect when training on a GPU")
        if cfg.science_box_size is not None and not cfg.science_every_epochs:
            log.warning("science_box_size has no effect without science_every_epochs")
        for key in unused_data_keys(cfg, self.storage, self.backend, device.type):
            log.warning("%s has no effect with storage '%s' (backend %s)", key, self.storage, self.backend)
        # Bad data, and data that cannot fit, are found before the engine is built, not after.
        self.train_volumes, self.val_volumes = (
            VolumePair.open(volume_files(cfg, split), cfg.N_in_channels, cfg.N_out_channels, cfg.data_size)
            for split in ("train", "val")
        )
        val_side = self.val_volumes.nbody.shape[1]
        if cfg.science_box_size is not None and cfg.science_box_size > val_side:
            raise ConfigError(f"science_box_size {cfg.science_box_size} is larger than the validation box ({val_side})")
        if cfg.data_checks != "none":
            for volumes in (self.train_volumes, self.val_volumes):
                volumes.check_finite(cfg.data_size, seed=cfg.seed)
        self.loader_settings = LoaderSettings(
            self.backend,
            cfg.storage,
            cfg.device_storage_dtype,
            cfg.num_data_workers,
            cfg.data_prefetch,
            cfg.channels_last,
            cfg.gpu_direct_storage,
        )
        plan = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, dist.world_size)
        channels = cfg.N_in_channels + cfg.N_out_channels
        buffers = batch_buffer_bytes(
            self.storage, self.loader_settings, plan.micro_batch, cfg.data_size, channels, cfg.data_format
        )
        volumes = [self.train_volumes, self.val_volumes]
        check_memory(self.storage, volumes, self.loader_settings, dist.local_world_size, buffers)

        self.steps_per_epoch = cfg.Nsamples // cfg.global_batch_size
        total_steps = cfg.num_epochs * self.steps_per_epoch
        sched = cfg.lr_schedule
        if sched.warmup_steps and not warmup_applies(sched.scaling, cfg.global_batch_size, cfg.base_batch_size):
            log.info("no lr warm-up: it applies only when the lr is scaled up (scaling != none, global > base batch)")
        self.ds_config = resolve_ds_config(
            load_ds_template(cfg.deepspeed_config, cfg.deepspeed_overrides),
            plan,
            peak_lr(sched.start_lr, sched.scaling, cfg.global_batch_size, cfg.base_batch_size),
            device.type,
        )

        torch.manual_seed(cfg.seed)
        model = UNet(cfg.N_in_channels, cfg.N_out_channels, cfg.unet_width, cfg.unet_depth)
        model.init_weights(cfg.weight_init.conv_scale, cfg.weight_init.conv_bias)
        self.num_parameters = sum(p.numel() for p in model.parameters())

        def make_schedule(optimizer: torch.optim.Optimizer) -> ScaledCosineSchedule:
            return ScaledCosineSchedule(
                optimizer,
                start_lr=sched.start_lr,
                end_lr=sched.end_lr,
                warmup_steps=sched.warmup_steps,
                total_steps=total_steps,
                scaling=sched.scaling,
                global_batch=cfg.global_batch_size,
                base_batch=cfg.base_batch_size,
            )

        try:
            self.engine, _, _, self.schedule = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=self.ds_config, lr_scheduler=make_schedule
            )
        except (ValueError, TypeError, AssertionError) as err:  # DeepSpeed's own config checks (pydantic's span lines)
            what = cfg.deepspeed_config + (" with deepspeed_overrides" if cfg.deepspeed_overrides else "")
            raise ConfigError(f"DeepSpeed rejected {what}: {' '.join(str(err).split())}") from None
        except RuntimeError as err:  # a JIT build of DeepSpeed's FusedAdam that the probe could not foresee
            if "fused_adam" not in str(err):
                raise
            override = json.dumps({"optimizer": {"params": TORCH_FUSED_ADAM}})
            raise ConfigError(
                f"DeepSpeed could not build FusedAdam ({str(err).strip().splitlines()[0]}); "
                f"--deepspeed_overrides '{override}' trains with torch's fused Adam"
            ) from None
        self.schedule.follow(self.engine)  # steps skipped for overflow count: the schedule is at the engine's step
        skip_single_rank_reduction(self.engine)
        if cfg.compile:  # torch.compile of the module, through the engine (compiled on the first step)
            self.engine.compile(compile_kwargs={} if cfg.compile_mode == "default" else {"mode": cfg.compile_mode})
        elif cfg.compile_mode != "default":
            log.warning("compile_mode has no effect without compile: true")
        self.dtype = train_dtype(self.engine)

        # Where training stands: epoch index, micro-batches of it done, and what the summary reports.
        self.epoch, self.batch_in_epoch = 0, 0
        self.initial_val_loss: float | None = None
        self.nonfinite_losses, self.nonfinite_in_a_row = 0, 0
        self.resumed_at: tuple[int, int] | None = None
        if resume:
            state = load_checkpoint(self.engine, run_dir)
            self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
            self.initial_val_loss = float(state["initial_val_loss"])
            self.nonfinite_losses = int(state.get("nonfinite_losses", 0))
            self.resumed_at = (self.epoch, self.batch_in_epoch)
            log.info(
                "resumed at step %d: epoch %d, %d batch(es) into it",
                self.engine.global_steps,
                self.epoch + 1,
                self.batch_in_epoch,
            )

        # One small collective per micro-step, when asked for: non-finite loss, bad batch, stop request.
        self.check_each_step = cfg.nonfinite_loss != "ignore" or cfg.data_checks == "every_batch"
        self.train_loader, self.val_loader = self._build_loaders()
        self.runlog = RunLog(run_dir, enabled=dist.is_main)
        self.first_batch_digest: str | None = None
        self.stopping = False  # set on every rank alike by agree()
        self.profiler: torch.profiler.profile | None = None

    def _build_loaders(self) -> tuple[Any, Any]:
        cfg, dist = self.cfg, self.dist
        micro = self.engine.train_micro_batch_size_per_gpu()
        accumulation = self.engine.gradient_accumulation_steps()
        augmenter = Augmenter(cfg.N_in_channels, cfg.N_out_channels, cfg.input_vectors, cfg.target_vectors)
        train_plan = DrawPlan(
            seed=cfg.seed + dist.rank,
            num_samples=self.steps_per_epoch * micro * accumulation,
            batch_size=micro,
            box_size=self.train_volumes.box_size,
            crop_size=cfg.data_size,
            rotate=cfg.rotate,
        )
        first, count = validation_share(cfg.Nsamples_val, micro, cfg.last_batch, dist.rank, dist.world_size)
        if count == 0:
            raise ConfigError(
                f"Nsamples_val {cfg.Nsamples_val} leaves rank {dist.rank} no validation samples "
                f"({dist.world_size} rank(s), batch {micro}, last_batch {cfg.last_batch})"
            )
        if cfg.last_batch == "drop" and count * dist.world_size != cfg.Nsamples_val:
            log.warning("validating on %d of %d samples (last_batch: drop)", count * dist.world_size, cfg.Nsamples_val)
        val_plan = DrawPlan(
            seed=cfg.seed,
            num_samples=count,
            batch_size=micro,
            box_size=self.val_volumes.box_size,
            crop_size=cfg.data_size,
            rotate=False,
            validation=True,
            first_index=first,
        )
        device = torch.device(self.device.type, self.device.index)
        common = dict(
            augmenter=augmenter, settings=self.loader_settings, storage=self.storage, device=device, dtype=self.dtype
        )
        return (
            build_loader(
                self.train_volumes, train_plan, first_epoch=self.epoch, first_batch=self.batch_in_epoch, **common
            ),
            build_loader(self.val_volumes, val_plan, **common),
        )

    def wait_for_every_rank(self) -> None:
        """Return once every rank has built its trainer (passed its checks); one that failed says why itself."""
        try:
            torch_dist.barrier()
        except RuntimeError:  # a rank that stopped on bad input closed its connections
            raise DistError("another rank stopped before training started (its output says why)") from None

    def close(self) -> None:
        """Stop the loaders' work ahead (threads, DALI pipelines) and a profiler left running by an error."""
        self._stop_profiler()
        for loader in (self.train_loader, self.val_loader):
            loader.close()

    def _start_profiler(self) -> None:
        """A torch.profiler trace of micro-steps 3 to 5 (the first two skipped as warm-up) into the run
        directory's ``profile/``, one file per rank: TensorBoard's profiler plugin or Perfetto reads it."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(
            str(self.run_dir / PROFILE), worker_name=f"rank{self.dist.rank}"
        )
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=PROFILE_STEPS, repeat=1)
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=handler)
        self.profiler.start()
        log.info("profiling micro-steps 3 to %d into %s", 2 + PROFILE_STEPS, self.run_dir / PROFILE)

    def _stop_profiler(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def agree(self, *flags: torch.Tensor) -> list[bool]:
        """``flags`` (0-d tensors, nonzero for true) ORed over the ranks, in one small reduction (one sync); this
        rank's stop request (SIGTERM, SIGUSR1) travels with them, and ``stopping`` becomes true on every rank when
        any rank was asked to stop. The only place where ranks agree on what to do next."""
        requested = float(self.stop is not None and self.stop.requested)
        local = torch.stack([*(f.float() for f in flags), torch.tensor(requested, device=self.engine.device)])
        torch_dist.all_reduce(local, op=torch_dist.ReduceOp.MAX)
        *agreed, stop = (bool(v) for v in local.tolist())
        self.stopping = self.stopping or stop
        return agreed

    def check_step(self, loss: torch.Tensor, inp: torch.Tensor, tar: torch.Tensor) -> bool:
        """Whether every rank goes on with this micro-step (``micro_step``'s ``proceed``): a non-finite batch
        anywhere stops the run (data_checks: every_batch); a non-finite loss anywhere skips the micro-step on every
        rank, or stops the run (``nonfinite_loss``)."""
        bad_batch = torch.zeros((), device=loss.device)
        if self.cfg.data_checks == "every_batch":
            bad_batch = ~(torch.isfinite(inp).all() & torch.isfinite(tar).all())
        nonfinite, bad = self.agree(~torch.isfinite(loss.detach()), bad_batch)
        if bad:
            raise DataError(
                f"a training batch holds NaN or Inf values (epoch {self.epoch + 1}, "
                f"batch {self.batch_in_epoch}); data_checks: every_batch"
            )
        if nonfinite and self.cfg.nonfinite_loss != "ignore":
            self._on_nonfinite_loss(self.epoch)
            return False
        self.nonfinite_in_a_row = 0
        return True

    def _on_nonfinite_loss(self, epoch: int) -> None:
        """A NaN or Inf loss on some rank: every rank skips this micro-batch, or the run stops."""
        self.nonfinite_losses += 1
        self.nonfinite_in_a_row += 1
        where = f"epoch {epoch + 1}, batch {self.batch_in_epoch}, after step {self.engine.global_steps}"
        if self.cfg.nonfinite_loss == "stop":
            raise NumericalError(f"non-finite loss at {where} (nonfinite_loss: stop)")
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_in_a_row:
            raise NumericalError(
                f"{self.nonfinite_in_a_row} non-finite losses in a row, the last at {where}: stopping "
                f"(max_nonfinite_in_a_row {self.cfg.max_nonfinite_in_a_row})"
            )
        log.warning("non-finite loss at %s: batch skipped (%d so far)", where, self.nonfinite_losses)

    def _save(self) -> None:
        state = {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "initial_val_loss": self.initial_val_loss,
            "nonfinite_losses": self.nonfinite_losses,
            "config_name": self.name,
        }
        tag = save_checkpoint(self.engine, self.run_dir, state, self.cfg.checkpoint_keep)
        log.info("checkpoint %s saved", tag)

    def _science_metrics(self) -> None:
        """Rank 0 predicts the validation box (or its fixed sub-volume at the origin, science_box_size, taken
        as periodic), tiled as ``python -m model.predict`` does, and logs the statistics of model.metrics
        (L1 per channel, power-spectrum ratio and r(k) at low k)."""
        if self.dist.is_main:
            cfg, volumes = self.cfg, self.val_volumes
            side = cfg.science_box_size or volumes.nbody.shape[1]
            region = np.s_[:, :side, :side, :side]
            micro = self.engine.train_micro_batch_size_per_gpu()
            pred = predict_box(
                self.engine.module,
                np.asarray(volumes.nbody[region]),
                cfg.N_out_channels,
                cfg.data_size,
                cfg.data_size // 4,
                micro,
                self.engine.device,
            )
            attrs = h5py.File(volumes.files.targets, "r").attrs if volumes.files.format == "hdf5" else {}
            truth = np.asarray(volumes.hydro[region], dtype=np.float32)
            metrics = compare(pred, truth, Normalization.from_attrs(attrs))
            scalars = {"science/box_size": float(side)}
            scalars |= {f"science/l1_{name}": value for name, value in metrics["l1"].items()}
            scalars |= {f"science/{name}": value for name, value in metrics["summary"].items()}
            self.runlog.write(self.engine.global_steps, epoch=self.epoch + 1, **scalars)
            log.info(
                "science metrics: %s", ", ".join(f"{k.removeprefix('science/')} {v:.4f}" for k, v in scalars.items())
            )
        self.engine.train()

    def _gather_losses(self, interval: Interval) -> tuple[float, list[float]]:
        """Training loss over the interval: the mean over ranks, and each rank's.

        One all_gather, which synchronizes the device: log points are where that is paid.
        """
        local = torch.tensor([0.0, float(interval.micro_steps)], dtype=torch.float64, device=self.engine.device)
        if interval.loss_sum is not None:
            local[0] = interval.loss_sum.double()
        per_rank = [torch.empty_like(local) for _ in range(self.dist.world_size)]
        torch_dist.all_gather(per_rank, local)
        totals = torch.stack(per_rank).cpu()
        mean = float(totals[:, 0].sum() / totals[:, 1].sum()) if totals[:, 1].sum() else float("nan")
        return mean, (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist()

    def _rank_digests(self) -> dict[str, list[str]]:
        """Per-rank sha256 of the weights (equal when ranks are in sync) and of the first batch drawn."""
        weights = hashlib.sha256()
        for p in self.engine.module.parameters():
            weights.update(p.detach().float().cpu().numpy().tobytes())
        gathered: list[Any] = [None] * self.dist.world_size
        torch_dist.all_gather_object(gathered, (weights.hexdigest(), self.first_batch_digest))
        digests = {
            "rank_weight_digests": [g[0] for g in gathered],
            "rank_first_batch_digests": [g[1] for g in gathered],
        }
        if len(set(digests["rank_weight_digests"])) > 1:
            log.error("the ranks' weights differ at the end of training: %s", digests["rank_weight_digests"])
        return digests

    def train(self) -> dict[str, Any]:
        cfg, engine = self.cfg, self.engine
        wall_start = time.perf_counter()
        last_epoch = cfg.num_epochs if self.stop_after_epoch is None else min(cfg.num_epochs, self.stop_after_epoch)
        log.info(
            "training %s: %d parameters, %s on %s, %d rank(s), micro-batch %d x accumulation %d = global batch %d",
            self.name,
            self.num_parameters,
            precision_name(self.dtype),
            _device_name(self.device),
            self.dist.world_size,
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
            cfg.global_batch_size,
        )
        if self.initial_val_loss is None:
            self.initial_val_loss = evaluate(engine, self.val_loader, cfg.lambda_rho)
            self.runlog.write(0, epoch=0, **{"loss/valid": self.initial_val_loss})
            log.info("initial validation loss %.5f", self.initial_val_loss)

        if self.profile:
            self._start_profiler()
        intervals: list[dict[str, float]] = []
        val_loss: float | None = None if self.resumed_at else self.initial_val_loss
        stopped = False
        show_bar = self.dist.is_main and sys.stderr.isatty()
        with logging_redirect_tqdm():  # log lines print above the progress bar
            while self.epoch < last_epoch and not stopped:
                stopped = self._train_epoch(intervals, show_bar)
                if stopped:
                    break
                val_loss = evaluate(engine, self.val_loader, cfg.lambda_rho)
                self.runlog.write(engine.global_steps, epoch=self.epoch + 1, **{"loss/valid": val_loss})
                log.info("epoch %d/%d: validation loss %.5f", self.epoch + 1, cfg.num_epochs, val_loss)
                if cfg.science_every_epochs and (self.epoch + 1) % cfg.science_every_epochs == 0:
                    self._science_metrics()
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                self._save()
                if self.epoch < last_epoch:
                    self.agree()
                stopped = self.stopping
        if stopped:
            log.warning(
                "stopped on request (%s) at step %d after a checkpoint: continue with --resume",
                self.stop.signal_name or "another rank's signal",
                engine.global_steps,
            )

        # The first interval holds start-up work (kernel selection, first batches): not a rate.
        measured = intervals[1:] or intervals
        summary = {
            "config": self.name,
            "initial_val_loss": self.initial_val_loss,
            "final_val_loss": val_loss,
            "epochs": self.epoch,
            "finished": self.epoch == cfg.num_epochs,
            "preempted": stopped,
            "resumed_from": None
            if self.resumed_at is None
            else {"epoch": self.resumed_at[0], "batch_in_epoch": self.resumed_at[1]},
            "steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "nonfinite_losses": self.nonfinite_losses,
            "wall_s": round(time.perf_counter() - wall_start, 3),
            "samples_per_s": statistics.median(m["throughput/samples_per_s"] for m in measured) if measured else None,
            "data_wait_pct": statistics.median(m["data_wait_pct"] for m in measured) if measured else None,
            "world_size": self.dist.world_size,
            "launched_by": self.dist.source,
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "accumulation": engine.gradient_accumulation_steps(),
            "global_batch": engine.train_batch_size(),
            "device": _device_name(self.device),
            "precision": precision_name(self.dtype),
            "zero_stage": engine.zero_optimization_stage(),
            "storage": self.storage,
            "backend": self.backend,
            "parameters": self.num_parameters,
            **self._rank_digests(),
        }
        self.run.write_summary(summary)
        self._stop_profiler()
        self.runlog.close()
        torch_dist.barrier()  # no rank leaves before rank 0 has written: under srun, the first to exit ends the step
        if not stopped:
            log.info("done: validation loss %.5f -> %.5f in %.1f s", self.initial_val_loss, val_loss, summary["wall_s"])
        return summary

    def _train_epoch(self, intervals: list[dict[str, float]], show_bar: bool) -> bool:
        """Train the rest of epoch ``self.epoch``; True when stopped on request (after a checkpoint)."""
        cfg, engine = self.cfg, self.engine
        done_steps = self.batch_in_epoch // engine.gradient_accumulation_steps()
        bar = tqdm(
            total=self.steps_per_epoch,
            initial=done_steps,
            desc=f"epoch {self.epoch + 1}/{cfg.num_epochs}",
            disable=not show_bar,
            leave=False,
        )
        interval = Interval(time.perf_counter())
        batches = iter(self.train_loader)
        while True:
            wait_start = time.perf_counter()  # time blocked on the pipeline: what it costs the step
            try:
                with phase("data_wait"):
                    inp, tar = next(batches)
            except StopIteration:
                break
            interval.data_wait_s += time.perf_counter() - wait_start
            self.batch_in_epoch += 1
            if self.first_batch_digest is None:  # once per run: which crops this rank drew
                self.first_batch_digest = hashlib.sha256(inp.float().cpu().numpy().tobytes()).hexdigest()
            step_before = engine.global_steps
            proceed = functools.partial(self.check_step, inp=inp, tar=tar) if self.check_each_step else None
            loss = micro_step(engine, inp, tar, cfg.lambda_rho, proceed)
            if self.profiler is not None:
                self.profiler.step()
            if loss is None:
                continue  # skipped on every rank alike: no backward, no step for this micro-batch
            interval.add(loss)
            if engine.global_steps == step_before:
                continue  # inside a gradient accumulation
            interval.steps += 1
            bar.update(1)
            if engine.global_steps % cfg.log_every_steps == 0:
                intervals.append(self._log_interval(interval, bar))
                interval = Interval(time.perf_counter())
            if self.stopping:  # at an optimizer-step boundary, agreed by every rank
                bar.close()
                self._save()
                return True
        if interval.steps:
            intervals.append(self._log_interval(interval, bar))
        bar.close()
        return False  # a stop agreed on by now comes after the epoch's validation and checkpoint

    def _log_interval(self, interval: Interval, bar: tqdm) -> dict[str, float]:
        engine = self.engine
        loss, per_rank = self._gather_losses(interval)  # synchronizes the device: the rate below is honest
        self.agree()  # a stop requested on any rank is seen by every rank at the same log point
        elapsed = time.perf_counter() - interval.start
        rate = interval.steps * self.cfg.global_batch_size / elapsed
        lr = self.schedule.lr_at(self.schedule.steps_taken)  # what the last step used
        values = {
            "loss/train": loss,
            "lr": lr,
            "throughput/samples_per_s": rate,
            "data_wait_pct": 100 * interval.data_wait_s / elapsed,
            "loss_scale": loss_scale(engine),
            "skipped_steps": engine.skipped_steps,
            "nonfinite_losses": self.nonfinite_losses,
            "memory/host_rss_mib": psutil.Process().memory_info().rss / 2**20,
            "memory/device_peak_gib": (
                torch.cuda.max_memory_allocated(self.device.index) / 2**30 if self.device.type == "cuda" else None
            ),
        }
        self.runlog.write(
            engine.global_steps,
            epoch=self.epoch + 1,
            samples=engine.global_steps * self.cfg.global_batch_size,
            **{"loss/train_per_rank": per_rank},
            **{k: v for k, v in values.items() if v is not None},
        )
        bar.set_postfix(loss=f"{loss:.4f}", rate=f"{rate:.0f}/s")
        log.info(
            "epoch %d step %d: loss %.5f, lr %.3g, %.1f samples/s, %.0f%% waiting for data",
            self.epoch + 1,
            engine.global_steps,
            loss,
            lr,
            rate,
            values["data_wait_pct"],
        )
        return values
