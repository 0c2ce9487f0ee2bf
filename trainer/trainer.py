"""The training loop: a DeepSpeed engine fed by the input pipeline, validated every epoch, checkpointed, resumable.

The micro-step itself is ``trainer.step.micro_step``, which the benchmarks and tests run too; validation is
``trainer.validation``; what a log point says about learning, ``trainer.numerics``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as torch_dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from common.tensors import precision_name, tensor_digest
from pipeline.storage import device_bytes, size_text
from trainer.build import build_data, build_engine, build_loss, run_facts
from trainer.checkpoint import Cadence, Checkpointer, load_checkpoint
from trainer.config import Config
from trainer.dist import Device, DistEnv, device_name
from trainer.errors import DistError, out_of_memory
from trainer.loss_scaling import loss_scale
from trainer.numerics import LearningWatch
from trainer.preemption import StopRequest
from trainer.profiling import StepProfiler
from trainer.provenance import rank_facts, software
from trainer.rundir import PROFILE, RunDir
from trainer.runlog import RunLog
from trainer.step import StepGuard, micro_step, phase
from trainer.validation import evaluate, science_scalars

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
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
        *,
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
        self.data = build_data(cfg, dist, device)
        self.setup = setup = build_engine(cfg, dist, device)
        self.engine, self.schedule, self.ds_config = setup.engine, setup.schedule, setup.ds_config
        self.dtype, self.num_parameters, self.steps_per_epoch = setup.dtype, setup.parameters, setup.steps_per_epoch

        # Where training stands: epoch index, micro-batches of it done, and what the summary reports.
        self.epoch, self.batch_in_epoch = 0, 0
        self.initial_val_loss: float | None = None
        self.val_loss: float | None = None  # the last validation's
        self.interval = Interval(start=time.perf_counter())  # since the last log point
        nonfinite_losses = 0
        self.resumed_at: tuple[int, int] | None = None
        if resume:
            state = load_checkpoint(self.engine, run_dir)
            self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
            self.initial_val_loss = float(state["initial_val_loss"])
            nonfinite_losses = int(state.get("nonfinite_losses", 0))
            self.resumed_at = (self.epoch, self.batch_in_epoch)
            log.info(
                "resumed at step %d: epoch %d, %d batch(es) into it",
                self.engine.global_steps,
                self.epoch + 1,
                self.batch_in_epoch,
            )

        # One small collective per micro-step, when asked for: non-finite loss, bad batch, stop request.
        self.guard = StepGuard(cfg, self.engine.device, stop, nonfinite_losses=nonfinite_losses)
        # after a resume: from the weights it loaded
        self.watch = LearningWatch(self.engine, self.schedule.lr_at, self.schedule.peak, warn=dist.is_main)
        self.loss_fn = build_loss(cfg)
        micro = self.engine.train_micro_batch_size_per_gpu()
        accumulation = self.engine.gradient_accumulation_steps()
        self.train_loader = self.data.train_loader(
            dist,
            micro,
            accumulation,
            steps_per_epoch=self.steps_per_epoch,
            device=device,
            dtype=self.dtype,
            first_epoch=self.epoch,
            first_batch=self.batch_in_epoch,
        )
        self.val_loader = self.data.val_loader(dist, micro, device, dtype=self.dtype)
        resumed_step = self.engine.global_steps if resume else None
        self.runlog = RunLog(run_dir, enabled=dist.is_main, resumed_step=resumed_step)
        self.first_batch_digest: str | None = None
        self.profiler: StepProfiler | None = None
        self.checkpoints = Checkpointer(self.engine, run_dir, keep=cfg.checkpoint_keep)
        self.cadence = Cadence(
            every_epochs=cfg.checkpoint_every_epochs,
            every_steps=cfg.checkpoint_every_steps,
            every_minutes=cfg.checkpoint_every_minutes,
        )
        self.timed_save = False  # the clock's save, agreed at the last log point
        self.save_at_epoch_end = False  # a save due at an epoch's last step, made once the epoch is done
        # (step, epoch, batch) of the newest checkpoint: the one resumed from, then each this run saves
        self.saved = (self.engine.global_steps, self.epoch, self.batch_in_epoch) if resume else None

    def wait_for_every_rank(self) -> None:
        """Return once every rank has built its trainer (passed its checks); one that failed says why itself."""
        try:
            torch_dist.barrier()
        except RuntimeError:  # a rank that stopped on bad input closed its connections
            raise DistError("another rank stopped before training started (its output says why)") from None

    def close(self) -> None:
        """Stop the loaders' work ahead (threads, DALI pipelines) and a profiler left running by an error."""
        if self.profiler is not None:
            self.profiler.stop()
        for loader in (self.train_loader, self.val_loader):
            loader.close()

    def _where(self) -> str:
        """The micro-step being taken, for messages."""
        return f"epoch {self.epoch + 1}, batch {self.batch_in_epoch}, after step {self.engine.global_steps}"

    def _save(self, *, wait: bool = False) -> None:
        """A checkpoint of this step (none where one was just saved); with ``wait``, on disk and latest on return."""
        self.cadence.saved()
        self.timed_save = False  # this save is the clock's too
        position = (self.engine.global_steps, self.epoch, self.batch_in_epoch)
        if self.saved == position:  # saved already (a step's cadence, then a stop at that step)
            if wait:
                self.checkpoints.finish()
            return
        state = {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "initial_val_loss": self.initial_val_loss,
            "nonfinite_losses": self.guard.nonfinite_losses,
            "config_name": self.name,
        }
        self.run.check_held()
        tag = self.checkpoints.save(state, wait=wait)
        self.saved = position
        log.info("checkpoint %s saved", tag)

    def _science_metrics(self) -> None:
        """Rank 0 predicts the validation box and logs its science metrics (``science_scalars``)."""
        if self.dist.is_main:
            scalars = science_scalars(self.engine, self.data.val, self.cfg)
            self.runlog.write(self.engine.global_steps, epoch=self.epoch + 1, **scalars)
            log.info(
                "science metrics: %s", ", ".join(f"{k.removeprefix('science/')} {v:.4f}" for k, v in scalars.items())
            )

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

    def train(self) -> dict[str, Any]:
        """Train to the end (or a stop request); a micro-batch that does not fit in GPU memory is a one-line error."""
        try:
            return self._train()
        except torch.OutOfMemoryError as err:
            log.debug("out of memory at %s: %s", self._where(), err)
            micro = self.engine.train_micro_batch_size_per_gpu()
            data = self.data
            resident = data.settings.storage.on_device
            volumes = (
                size_text(device_bytes([data.train, data.val], self.cfg.device_storage_dtype)) if resident else None
            )
            where = self._where()
            raise out_of_memory(
                err, micro, self.cfg.data_size, device=device_name(self.device), where=where, volumes=volumes
            ) from None

    def _train(self) -> dict[str, Any]:
        cfg, engine = self.cfg, self.engine
        wall_start = time.perf_counter()
        last_epoch = cfg.num_epochs if self.stop_after_epoch is None else min(cfg.num_epochs, self.stop_after_epoch)
        log.info(
            "training %s: %d parameters, %s on %s, %d rank(s), micro-batch %d x accumulation %d = global batch %d",
            self.name,
            self.num_parameters,
            precision_name(self.dtype),
            device_name(self.device),
            self.dist.world_size,
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
            cfg.global_batch_size,
        )
        if self.initial_val_loss is None:
            self.initial_val_loss = evaluate(engine, self.val_loader, self.loss_fn)
            self.runlog.write(0, epoch=0, **{"loss/valid": self.initial_val_loss})
            log.info("initial validation loss %.5f", self.initial_val_loss)

        if self.profile:
            on_gpu, compiled = self.device.type == "cuda", bool(cfg.compile)
            self.profiler = StepProfiler(
                engine.module, self.run_dir / PROFILE, self.dist.rank, on_gpu=on_gpu, compiled=compiled
            )
        intervals: list[dict[str, float]] = []
        self.val_loss = None if self.resumed_at else self.initial_val_loss
        stopped = False
        show_bar = self.dist.is_main and sys.stderr.isatty()
        with logging_redirect_tqdm():  # log lines print above the progress bar
            while self.epoch < last_epoch and not stopped:
                stopped = self._train_epoch(intervals, show_bar=show_bar) or self._end_epoch(last_epoch)
        if stopped:
            log.warning(
                "stopped on request (%s) at step %d after a checkpoint: continue with --resume",
                self.stop.signal_name or "another rank's signal",
                engine.global_steps,
            )

        self.checkpoints.finish()
        val_loss = self.val_loss
        summary = self._summary(intervals, val_loss, stopped=stopped, wall_s=time.perf_counter() - wall_start)
        self.run.write_summary(summary)
        if self.profiler is not None:
            self.profiler.stop()
        self.runlog.close()
        torch_dist.barrier()  # no rank leaves before rank 0 has written: under srun, the first to exit ends the step
        if not stopped:
            log.info("done: validation loss %.5f -> %.5f in %.1f s", self.initial_val_loss, val_loss, summary["wall_s"])
        return summary

    def _summary(
        self, intervals: list[dict[str, float]], val_loss: float | None, *, stopped: bool, wall_s: float
    ) -> dict[str, Any]:
        """summary.json: how the run went, what learned, how fast, and what ran where (a collective: every rank)."""
        # The first interval holds start-up work (kernel selection, first batches): not a rate.
        measured = intervals[1:] or intervals
        return {
            "config": self.name,
            "initial_val_loss": self.initial_val_loss,
            "final_val_loss": val_loss,
            "epochs": self.epoch,
            "finished": self.epoch == self.cfg.num_epochs,
            "preempted": stopped,
            "resumed_from": None
            if self.resumed_at is None
            else {"epoch": self.resumed_at[0], "batch_in_epoch": self.resumed_at[1]},
            "steps": self.engine.global_steps,
            "skipped_steps": self.engine.skipped_steps,
            "last_loss_scale": loss_scale(self.engine),
            "weights_changed": self.watch.weights_changed(),
            "nonfinite_losses": self.guard.nonfinite_losses,
            "wall_s": round(wall_s, 3),
            "samples_per_s": statistics.median(m["throughput/samples_per_s"] for m in measured) if measured else None,
            "data_wait_pct": statistics.median(m["data_wait_pct"] for m in measured) if measured else None,
            **run_facts(self.setup, self.data, self.dist),
            "launched_by": self.dist.source,
            "device": device_name(self.device),
            **software(),
            "rendezvous": f"{self.dist.master_addr}:{self.dist.master_port}",
            **rank_facts(self.engine.module, self.first_batch_digest, self.dist.world_size),
        }

    def _train_epoch(self, intervals: list[dict[str, float]], *, show_bar: bool) -> bool:
        """Train the rest of epoch ``self.epoch``, one optimizer step at a time; True when stopped on request (after
        a checkpoint). A stop agreed on at the epoch's end comes after its validation and checkpoint."""
        cfg, engine = self.cfg, self.engine
        done_steps = self.batch_in_epoch // engine.gradient_accumulation_steps()
        desc = f"epoch {self.epoch + 1}/{cfg.num_epochs}"
        bar = tqdm(total=self.steps_per_epoch, initial=done_steps, desc=desc, disable=not show_bar, leave=False)
        self.interval = Interval(start=time.perf_counter())
        for step_in_epoch, _ in enumerate(self._optimizer_steps(), start=done_steps + 1):
            self.interval.steps += 1
            bar.update(1)
            if engine.global_steps % cfg.log_every_steps == 0:
                intervals.append(self._log_interval(self.interval, bar))
                self.interval = Interval(start=time.perf_counter())
            if self.guard.stopping:  # agreed by every rank, at this step
                bar.close()
                self._save(wait=True)
                return True
            if self.cadence.after_step(engine.global_steps, timed=self.timed_save):
                self.timed_save = False
                if step_in_epoch == self.steps_per_epoch:  # the epoch's end saves it, with the epoch done
                    self.save_at_epoch_end = True
                else:
                    self._save()
        if self.interval.steps:
            intervals.append(self._log_interval(self.interval, bar))
        bar.close()
        return False

    def _end_epoch(self, last_epoch: int) -> bool:
        """Validation, science metrics where due, and a checkpoint where due (always after the last epoch and before a
        stop); True where a stop was requested meanwhile."""
        cfg, engine = self.cfg, self.engine
        self.val_loss = evaluate(engine, self.val_loader, self.loss_fn)
        self.runlog.write(engine.global_steps, epoch=self.epoch + 1, **{"loss/valid": self.val_loss})
        log.info("epoch %d/%d: validation loss %.5f", self.epoch + 1, cfg.num_epochs, self.val_loss)
        if cfg.science_every_epochs and (self.epoch + 1) % cfg.science_every_epochs == 0:
            self._science_metrics()
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if self.epoch < last_epoch:
            self.guard.agree()
        last = self.guard.stopping or self.epoch == last_epoch
        if last or self.save_at_epoch_end or self.cadence.after_epoch(self.epoch, last=last_epoch):
            self.save_at_epoch_end = False
            self._save(wait=last)
        return self.guard.stopping

    def _optimizer_steps(self) -> Iterator[None]:
        """Takes the epoch's optimizer steps, yielding after each: its micro-batches from the loader, each through
        ``micro_step``, until DeepSpeed's accumulation boundary (a micro-batch skipped for a non-finite loss is
        not counted, as DeepSpeed does not count it). Losses and waits go to the current ``interval``. Ends with
        the epoch's batches."""
        engine, batches = self.engine, iter(self.train_loader)
        while True:
            stepped = False
            while not stepped:
                wait_start = time.perf_counter()  # time blocked on the pipeline: what it costs the step
                with phase("data_wait"):
                    batch = next(batches, None)
                if batch is None:
                    return
                self.interval.data_wait_s += time.perf_counter() - wait_start
                inputs, targets = batch
                self.batch_in_epoch += 1
                if self.first_batch_digest is None:  # once per run: which crops this rank drew
                    self.first_batch_digest = tensor_digest([inputs])
                boundary = engine.is_gradient_accumulation_boundary()
                loss = micro_step(
                    engine,
                    inputs,
                    targets,
                    loss_fn=self.loss_fn,
                    guard=self.guard,
                    where=self._where,
                    after_backward=self.watch.after_backward,
                )
                if self.profiler is not None:
                    self.profiler.step()
                if loss is not None:  # None: skipped on every rank alike, no backward, no step
                    self.interval.add(loss)
                    stepped = boundary
            yield

    def _log_interval(self, interval: Interval, bar: tqdm) -> dict[str, float]:
        engine = self.engine
        loss, per_rank = self._gather_losses(interval)  # synchronizes the device: the rate below is honest
        # a stop requested on any rank, and rank 0's clock for a timed save, seen by every rank at this log point
        clock = torch.tensor(float(self.dist.is_main and self.cadence.clock_due()), device=engine.device)
        (self.timed_save,) = self.guard.agree(clock)
        elapsed = time.perf_counter() - interval.start
        rate = interval.steps * self.cfg.global_batch_size / elapsed
        lr = self.schedule.lr_at(self.schedule.steps_taken)  # what the last step used
        numerics = self.watch.report()
        values = {
            "loss/train": loss,
            "lr": lr,
            "throughput/samples_per_s": rate,
            "data_wait_pct": 100 * interval.data_wait_s / elapsed,
            "grad_norm": numerics.grad_norm,
            "loss_scale": numerics.loss_scale,
            "weights_changed": numerics.weights_changed,
            "skipped_steps": engine.skipped_steps,
            "nonfinite_losses": self.guard.nonfinite_losses,
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
            "epoch %d step %d: loss %.5f, lr %.3g, %s, %.1f samples/s, %.0f%% waiting for data",
            self.epoch + 1,
            engine.global_steps,
            loss,
            lr,
            numerics.console(),
            rate,
            values["data_wait_pct"],
        )
        return values
