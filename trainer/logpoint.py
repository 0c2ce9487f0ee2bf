"""What a run says every ``log_every_steps`` optimizer steps: the training loss over all ranks, the learning rate, the
throughput and the wait for data, what the learning watch sees, and memory; to the console, metrics.jsonl and
TensorBoard. Nothing here reads the device between log points: the losses stay there until the one gather."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import torch.distributed as torch_dist

from trainer.lr_schedule import Schedule
from trainer.noise import Estimate, NoiseScale
from trainer.numerics import LearningWatch
from trainer.runlog import RunLog
from trainer.step import StepGuard, StepResult

log = logging.getLogger("trainer.trainer")


@dataclass(kw_only=True)
class Interval:
    """Optimizer steps and losses since the last log point; losses stay on the device until then."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    loss_sum: torch.Tensor | None = None
    micro_steps: int = 0
    data_wait_s: float = 0.0

    def add(self, result: StepResult) -> None:
        self.steps += result.stepped
        self.data_wait_s += result.data_wait_s
        for loss in result.losses:
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
            self.micro_steps += 1


class LogPoints:
    """The log points of one run: ``add`` after each step, ``due`` to ask, ``log`` to say; ``rates`` for the summary."""

    def __init__(
        self,
        engine: Any,
        *,
        runlog: RunLog,
        watch: LearningWatch,
        schedule: Schedule,
        guard: StepGuard,
        every: int,
        noise: NoiseScale | None = None,
    ) -> None:
        self.engine, self.runlog, self.watch, self.schedule, self.guard = engine, runlog, watch, schedule, guard
        self.every, self.noise = every, noise
        self.noise_estimate: Estimate | None = None  # the last log point's
        self.interval = Interval()
        self.intervals: list[dict[str, float]] = []

    def add(self, result: StepResult) -> None:
        self.interval.add(result)

    def due(self, result: StepResult) -> bool:
        return result.stepped and self.engine.global_steps % self.every == 0

    def restart(self) -> None:
        """A new interval from now (an epoch's first step: validation is not training time)."""
        self.interval = Interval()

    def _gather_losses(self) -> tuple[float, list[float]]:
        """Training loss over the interval: the mean over ranks, and each rank's. One all_gather, which synchronizes
        the device: log points are where that is paid."""
        interval = self.interval
        local = torch.tensor([0.0, float(interval.micro_steps)], dtype=torch.float64, device=self.engine.device)
        if interval.loss_sum is not None:
            local[0] = interval.loss_sum.double()
        per_rank = [torch.empty_like(local) for _ in range(torch_dist.get_world_size())]
        torch_dist.all_gather(per_rank, local)
        totals = torch.stack(per_rank).cpu()
        mean = float(totals[:, 0].sum() / totals[:, 1].sum()) if totals[:, 1].sum() else float("nan")
        return mean, (totals[:, 0] / totals[:, 1].clamp(min=1)).tolist()

    def log(self, *, epoch: int, device: torch.device) -> dict[str, float]:
        """Say the interval (every rank takes part: one gather and the stop request's agreement), start the next."""
        engine, interval = self.engine, self.interval
        loss, per_rank = self._gather_losses()  # synchronizes the device: the rate below is honest
        self.guard.agree()  # a stop requested on any rank, seen by every rank at this log point
        elapsed = time.perf_counter() - interval.start
        rate = interval.steps * engine.train_batch_size() / elapsed
        lr = self.schedule.lr_at(self.schedule.steps_taken)  # what the last step used
        numerics = self.watch.report()
        if self.noise is not None:
            self.noise_estimate = self.noise.report() or self.noise_estimate
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
                torch.cuda.max_memory_allocated(device.index) / 2**30 if device.type == "cuda" else None
            ),
        }
        self.runlog.write(
            engine.global_steps,
            epoch=epoch,
            samples=engine.global_steps * engine.train_batch_size(),
            **{"loss/train_per_rank": per_rank},
            **{k: v for k, v in values.items() if v is not None},
            **(self.noise_estimate.scalars() if self.noise_estimate else {}),
        )
        critical = self.noise_estimate.b_simple if self.noise_estimate else None
        log.info(
            "epoch %d step %d: loss %.5f, lr %.3g, %s%s, %.1f samples/s, %.0f%% waiting for data",
            epoch,
            engine.global_steps,
            loss,
            lr,
            numerics.console(),
            "" if critical is None else f", critical batch ~ {critical:.0f}",
            rate,
            values["data_wait_pct"],
        )
        self.intervals.append(values)
        self.interval = Interval()
        return values

    def rates(self) -> dict[str, float | None]:
        """The median throughput and data wait over the run's intervals, the first left out where there are others
        (it holds start-up work: kernel selection, first batches)."""
        measured = self.intervals[1:] or self.intervals
        if not measured:
            return {"samples_per_s": None, "data_wait_pct": None}
        return {
            "samples_per_s": statistics.median(m["throughput/samples_per_s"] for m in measured),
            "data_wait_pct": statistics.median(m["data_wait_pct"] for m in measured),
        }
