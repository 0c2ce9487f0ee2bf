"""The training loop: a DeepSpeed engine fed by the input pipeline, one ``train_step`` after another, validated every
epoch, checkpointed where the checkpointer says, resumable.

The step itself is ``trainer.step.train_step``, which the benchmarks and tests run too; validation is
``trainer.validation``; what a log point says, ``trainer.logpoint``; when to save, ``trainer.checkpoint.Checkpointer``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as torch_dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from common.files import size_text
from common.tensors import precision_name, tensor_digest
from pipeline.storage import device_bytes
from trainer.build import build_engine, build_loss, run_facts
from trainer.checkpoint import Checkpointer, Position, load_checkpoint
from trainer.config import Config
from trainer.data import build_data, normalization
from trainer.dist import Device, DistEnv, device_name
from trainer.errors import DistError, out_of_memory
from trainer.logpoint import LogPoints
from trainer.loss_scaling import loss_scale
from trainer.noise import at_step as noise_at_step
from trainer.noise import for_run as noise_for_run
from trainer.numerics import LearningWatch
from trainer.preemption import StopRequest
from trainer.profiling import StepProfiler
from trainer.provenance import rank_facts, software
from trainer.rundir import PROFILE, RunDir
from trainer.runlog import RunLog
from trainer.step import StepGuard, train_step
from trainer.validation import evaluate, science_scalars

log = logging.getLogger(__name__)


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
        self.profile, self.stop_after_epoch, self.stop = profile, stop_after_epoch, stop
        self.data = build_data(cfg, dist, device)
        self.setup = setup = build_engine(cfg, dist, device)
        self.engine, self.schedule, self.ds_config = setup.engine, setup.schedule, setup.ds_config
        self.dtype, self.steps_per_epoch = setup.dtype, setup.steps_per_epoch
        self.accumulation = self.engine.gradient_accumulation_steps()

        # Where training stands: epoch index, micro-batches of it done, and what the summary reports.
        self.epoch, self.batch_in_epoch = 0, 0
        self.initial_val_loss: float | None = None
        self.val_loss: float | None = None  # the last validation's
        nonfinite_losses, self.resumed_at = 0, None
        if resume:
            state = load_checkpoint(self.engine, run.path)
            self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
            self.initial_val_loss = float(state["initial_val_loss"])
            nonfinite_losses = int(state.get("nonfinite_losses", 0))
            self.resumed_at = self._position()
            log.info("resumed at step %d: epoch %d, %d batch(es) into it", *self._where_parts())
            if partial := self.batch_in_epoch % self.accumulation:  # saved by an older loop mid-step
                self.batch_in_epoch -= partial
                log.warning("the checkpoint is %d micro-batch(es) into a step: that step is taken again", partial)

        # One small collective per micro-step, when asked for: non-finite loss, bad batch, stop request.
        self.guard = StepGuard(cfg.faults, self.engine.device, stop, nonfinite_losses=nonfinite_losses)
        # after a resume: from the weights it loaded
        self.watch = LearningWatch(self.engine, self.schedule.lr_at, self.schedule.peak, warn=dist.is_main)
        self.loss_fn = build_loss(cfg)
        micro = self.engine.train_micro_batch_size_per_gpu()
        self.train_loader = self.data.train_loader(
            dist,
            micro,
            self.accumulation,
            steps_per_epoch=self.steps_per_epoch,
            device=device,
            dtype=self.dtype,
            first_epoch=self.epoch,
            first_batch=self.batch_in_epoch,
        )
        self.val_loader = self.data.val_loader(dist, micro, device, dtype=self.dtype)
        self.runlog = RunLog(run.path, enabled=dist.is_main, resumed_step=self.engine.global_steps if resume else None)
        self.noise, self.pieces, said = noise_for_run(self.engine, asked=cfg.noise_scale)
        log.info("%s", said)
        self.logs = LogPoints(
            self.engine,
            runlog=self.runlog,
            watch=self.watch,
            schedule=self.schedule,
            guard=self.guard,
            every=cfg.log_every_steps,
            noise=self.noise,
        )
        self.first_batch_digest: str | None = None
        self.profiler: StepProfiler | None = None
        self.checkpoints = Checkpointer(
            self.engine,
            run.path,
            settings=cfg.checkpointing,
            batches_per_epoch=self.steps_per_epoch * self.accumulation,
            agree_every=cfg.log_every_steps,
            saved=self.resumed_at,
            before_save=run.check_held,
        )

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

    def _position(self) -> Position:
        return Position(step=self.engine.global_steps, epoch=self.epoch, batch_in_epoch=self.batch_in_epoch)

    def _where_parts(self) -> tuple[int, int, int]:
        return self.engine.global_steps, self.epoch + 1, self.batch_in_epoch

    def _where(self, index: int = -1) -> str:
        """The micro-batch ``index`` of the step being taken (-1: the step's start), for messages."""
        batch = self.batch_in_epoch + index + 1
        return f"epoch {self.epoch + 1}, batch {batch}, after step {self.engine.global_steps}"

    def _client_state(self) -> dict[str, Any]:
        """What a checkpoint keeps beside DeepSpeed's state."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "initial_val_loss": self.initial_val_loss,
            "nonfinite_losses": self.guard.nonfinite_losses,
            "config_name": self.name,
        }

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
            raise out_of_memory(
                err, micro, self.cfg.data_size, device=device_name(self.device), where=self._where(), volumes=volumes
            ) from None

    def _train(self) -> dict[str, Any]:
        cfg, engine = self.cfg, self.engine
        wall_start = time.perf_counter()
        last_epoch = cfg.num_epochs if self.stop_after_epoch is None else min(cfg.num_epochs, self.stop_after_epoch)
        log.info(
            "training %s: %d parameters, %s on %s, %d rank(s), micro-batch %d x accumulation %d = global batch %d",
            self.name,
            self.setup.parameters,
            precision_name(self.dtype),
            device_name(self.device),
            self.dist.world_size,
            engine.train_micro_batch_size_per_gpu(),
            self.accumulation,
            engine.train_batch_size(),
        )
        if self.initial_val_loss is None:
            self.initial_val_loss = evaluate(engine, self.val_loader, self.loss_fn)
            self.runlog.write(0, epoch=0, **{"loss/valid": self.initial_val_loss})
            log.info("initial validation loss %.5f", self.initial_val_loss)
        if self.profile:
            on_gpu, compiled = self.device.type == "cuda", bool(cfg.compile)
            self.profiler = StepProfiler(
                engine.module, self.run.path / PROFILE, self.dist.rank, on_gpu=on_gpu, compiled=compiled
            )
        self.val_loss = None if self.resumed_at else self.initial_val_loss
        stopped = False
        with logging_redirect_tqdm():  # log lines print above the progress bar
            while self.epoch < last_epoch and not stopped:
                stopped = self._train_epoch() or self._end_epoch(last_epoch)
        if stopped:
            log.warning(
                "stopped on request (%s) at step %d after a checkpoint: continue with --resume",
                self.stop.signal_name or "another rank's signal",
                engine.global_steps,
            )
        self.checkpoints.finish()
        summary = self._summary(stopped=stopped, wall_s=time.perf_counter() - wall_start)
        self.run.write_summary(summary)
        if self.profiler is not None:
            self.profiler.stop()
        self.runlog.close()
        torch_dist.barrier()  # no rank leaves before rank 0 has written: under srun, the first to exit ends the step
        if not stopped:
            log.info(
                "done: validation loss %.5f -> %.5f in %.1f s", self.initial_val_loss, self.val_loss, summary["wall_s"]
            )
        return summary

    def _summary(self, *, stopped: bool, wall_s: float) -> dict[str, Any]:
        """summary.json: how the run went, what learned, how fast, and what ran where (a collective: every rank)."""
        engine = self.engine
        return {
            "config": self.name,
            "initial_val_loss": self.initial_val_loss,
            "final_val_loss": self.val_loss,
            "epochs": self.epoch,
            "finished": self.epoch == self.cfg.num_epochs,
            "preempted": stopped,
            "resumed_from": None
            if self.resumed_at is None
            else {"epoch": self.resumed_at.epoch, "batch_in_epoch": self.resumed_at.batch_in_epoch},
            "steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "last_loss_scale": loss_scale(engine),
            "weights_changed": self.watch.weights_changed(),
            "nonfinite_losses": self.guard.nonfinite_losses,
            "wall_s": round(wall_s, 3),
            **self.logs.rates(),
            "noise_scale": vars(self.logs.noise_estimate) if self.logs.noise_estimate else None,
            **run_facts(self.setup, self.data, self.dist),
            "launched_by": self.dist.source,
            "device": device_name(self.device),
            **software(),
            "rendezvous": f"{self.dist.master_addr}:{self.dist.master_port}",
            **rank_facts(engine.module, self.first_batch_digest, self.dist.world_size),
        }

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's micro-batches; the first of the run's leaves its digest (which crops this rank drew)."""
        for batch in self.train_loader:
            if self.first_batch_digest is None:
                self.first_batch_digest = tensor_digest([batch[0]])
            yield batch

    def _train_epoch(self) -> bool:
        """Train the rest of epoch ``self.epoch``, one ``train_step`` at a time, each of ``accumulation`` micro-batches;
        True when stopped on request (after a checkpoint). A stop agreed at the epoch's end comes after its
        validation and checkpoint."""
        done_steps = self.batch_in_epoch // self.accumulation
        desc = f"epoch {self.epoch + 1}/{self.cfg.num_epochs}"
        show = self.dist.is_main and sys.stderr.isatty()
        bar = tqdm(total=self.steps_per_epoch, initial=done_steps, desc=desc, disable=not show, leave=False)
        batches = self._batches()
        self.logs.restart()
        for _ in range(done_steps, self.steps_per_epoch):
            noise, pieces = noise_at_step(self.noise, self.pieces, step=self.engine.global_steps, every=self.logs.every)
            result = train_step(
                self.engine,
                batches,
                loss_fn=self.loss_fn,
                guard=self.guard,
                where=self._where,
                after_backward=self.watch.after_backward,
                noise=noise,
                pieces=pieces,
                reduction=self.setup.reduction,
            )
            self.batch_in_epoch += self.accumulation
            if self.profiler is not None:
                self.profiler.step()
            bar.update(1)
            self.logs.add(result)
            if self.logs.due(result):
                values = self.logs.log(epoch=self.epoch + 1, device=self.device)
                bar.set_postfix(loss=f"{values['loss/train']:.4f}", rate=f"{values['throughput/samples_per_s']:.0f}/s")
            if self.guard.stopping:  # agreed by every rank, at this step
                bar.close()
                self.checkpoints.reached(self._position(), self._client_state, stopping=True)
                return True
            if result.stepped:
                self.checkpoints.reached(self._position(), self._client_state)
        if next(batches, None) is not None:  # the loader ends its epoch (and moves to the next) when it is exhausted
            raise RuntimeError(f"the training loader gave more than the {self.steps_per_epoch} steps of an epoch")
        if self.logs.interval.steps:
            self.logs.log(epoch=self.epoch + 1, device=self.device)
        bar.close()
        return False

    def _end_epoch(self, last_epoch: int) -> bool:
        """Validation, science metrics where due, and a checkpoint where due (always after the last epoch and before a
        stop); True where a stop was requested meanwhile."""
        cfg, engine = self.cfg, self.engine
        self.val_loss = evaluate(engine, self.val_loader, self.loss_fn)
        self.runlog.write(engine.global_steps, epoch=self.epoch + 1, **{"loss/valid": self.val_loss})
        log.info("epoch %d/%d: validation loss %.5f", self.epoch + 1, cfg.num_epochs, self.val_loss)
        science = cfg.science
        if science.every_epochs and (self.epoch + 1) % science.every_epochs == 0 and self.dist.is_main:
            norm = normalization(cfg, "val")
            scalars = science_scalars(engine, self.data.val, science, crop=cfg.data_size, norm=norm)
            self.runlog.write(engine.global_steps, epoch=self.epoch + 1, **scalars)
            log.info(
                "science metrics: %s", ", ".join(f"{k.removeprefix('science/')} {v:.4f}" for k, v in scalars.items())
            )
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if self.epoch < last_epoch:
            self.guard.agree()
        last = self.epoch == last_epoch
        self.checkpoints.reached(
            self._position(), self._client_state, epoch_end=True, last=last, stopping=self.guard.stopping
        )
        return self.guard.stopping
