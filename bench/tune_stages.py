"""The stages of ``bench.tune``: each one's candidate settings, from the config as tuned so far, or why the stage does
not apply here. A stage added to STAGES is tried in its place, and offered by ``--stages``."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bench.cases import PRECISIONS, bf16_supported
from pipeline.backends import BACKENDS
from pipeline.loaders import dali_installed, resolve_backend
from pipeline.storage import DEVICE, STORAGES, planned
from trainer.config import Config, channels_last_on
from trainer.engine import precision_of

if TYPE_CHECKING:
    from bench.tune import Tuner


@dataclass(kw_only=True)
class Candidate:
    """Settings tried in a stage, with what their runs measured and what became of them."""

    stage: str
    label: str
    settings: dict[str, Any]  # config keys set on top of the settings chosen so far
    rates: list[float] = field(default_factory=list)
    status: str = "pending"  # measured, failed, out of memory, not available here, not measured
    reason: str = ""
    wall_s: float = 0.0

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    def record(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "label": self.label,
            "settings": self.settings,
            "samples_per_s": self.median,
            "samples_per_s_runs": self.rates,
            "status": self.status,
            "reason": self.reason,
            "wall_s": round(self.wall_s, 1),
        }


# -- the settings each stage tries, in its order: candidates, or why the stage does not apply here -------------
Found = list[Candidate] | str


def _choices(stage: str, key: str, values: list[Any], *, now: Any, label: str, setting=lambda v: v) -> list[Candidate]:
    """One candidate per value of ``key``; the value chosen so far is the one with no settings."""
    return [
        Candidate(stage=stage, label=label.format(v), settings={} if v == now else {key: setting(v)}) for v in values
    ]


def _micro_batch(tuner: Tuner, cfg: Config, template: dict[str, Any]) -> Found:
    per_rank = cfg.global_batch_size // tuner.args.ranks
    sizes = [m for m in range(per_rank, 0, -1) if per_rank % m == 0][: tuner.args.micro_batches]
    now = cfg.micro_batch_size or per_rank
    return [
        Candidate(
            stage="micro_batch",
            label=f"micro {m} x accumulation {per_rank // m}",
            settings={} if m == now else {"micro_batch_size": m},
        )
        for m in sorted(set(sizes) | {now}, reverse=True)
    ]


def _precision(tuner: Tuner, cfg: Config, template: dict[str, Any]) -> Found:
    overrides = {name: p.overrides for name, p in PRECISIONS.items()}
    found = _choices(
        "precision",
        "deepspeed_overrides",
        list(PRECISIONS),
        now=precision_of(template),
        label="{}",
        setting=overrides.get,
    )
    for c in found:
        if c.label == "fp16" and tuner.device_type != "cuda":
            c.status, c.reason = "not available here", "fp16 training needs a GPU (DeepSpeed's CPU accelerator)"
        elif c.label == "bf16" and not bf16_supported(tuner.device_type):
            c.status, c.reason = "not available here", f"this {tuner.device_type} has no bf16 support"
    return found


def _threads(tuner: Tuner, cfg: Config, template: dict[str, Any]) -> Found:
    if tuner.device_type == "cuda":
        return "on a GPU the threads do not bound the step"
    cores = max(1, len(os.sched_getaffinity(0)) // tuner.args.ranks)
    now = cfg.cpu_threads or cores
    values = sorted({cores, max(1, cores // 2), now}, reverse=True)
    return _choices("threads", "cpu_threads", values, now=now, label="{} torch threads")


def _data_threads(tuner: Tuner, cfg: Config, template: dict[str, Any]) -> Found:
    if STORAGES.get(cfg.storage) is DEVICE:
        return "with storage device the crops are cut by the training device, not by data threads"
    now = cfg.num_data_workers
    return _choices("data_threads", "num_data_workers", sorted({1, 2, 4, now}), now=now, label="{} data threads")


def _fast_paths(tuner: Tuner, cfg: Config, template: dict[str, Any]) -> Found:
    if tuner.device_type != "cuda":
        return "channels-last, cuDNN autotuning and torch.compile are GPU fast paths"
    found = [Candidate(stage="fast_paths", label="as chosen so far", settings={})]
    # what each switch is on a GPU now (null: channels_last and cudnn_benchmark on), then its opposite
    now = {
        "channels_last": channels_last_on(cfg, "cuda"),
        "cudnn_benchmark": cfg.cudnn_benchmark is not False,
        "compile": cfg.compile,
    }
    for key, value in now.items():
        found.append(Candidate(stage="fast_paths", label=f"{key} {not value}", settings={key: not value}))
    if now["cudnn_benchmark"] and cfg.cudnn_benchmark_limit != 0:  # cuDNN times every algorithm it has
        limit = {"cudnn_benchmark_limit": 0}
        found.append(Candidate(stage="fast_paths", label="cudnn_benchmark_limit 0", settings=limit))
    return found


def _zero(tuner: Tuner, cfg: Config, template: dict[str, Any]) -> Found:
    if tuner.device_type != "cuda" or tuner.args.ranks == 1:
        return "ZeRO partitions state across ranks: tuned with several GPU ranks only"
    now = template.get("zero_optimization", {}).get("stage", 0)
    stage = lambda v: {"zero_optimization": {"stage": v}}  # noqa: E731
    return _choices("zero", "deepspeed_overrides", [0, 1, 2], now=now, label="ZeRO {}", setting=stage)


def _storage(tuner: Tuner, cfg: Config, template: dict[str, Any]) -> Found:
    return _choices("storage", "storage", list(STORAGES), now=cfg.storage, label="storage {}")


def _backend(tuner: Tuner, cfg: Config, template: dict[str, Any]) -> Found:
    now = resolve_backend(cfg.backend, tuner.device_type, planned(cfg.storage))
    found = _choices("backend", "backend", list(BACKENDS), now=now, label="backend {}")
    if not dali_installed():
        found[1].status, found[1].reason = "not available here", "NVIDIA DALI is not installed"
    return found


STAGES = {
    "micro_batch": _micro_batch,
    "precision": _precision,
    "threads": _threads,
    "data_threads": _data_threads,
    "fast_paths": _fast_paths,
    "zero": _zero,
    "storage": _storage,
    "backend": _backend,
}
