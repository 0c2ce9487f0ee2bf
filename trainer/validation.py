"""Validation: the loss over the validation set on every rank, and the science metrics of the validation box."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as torch_dist

from model import Loss
from model.evaluation import compare_box
from model.metrics import Normalization
from pipeline.volumes import VolumePair
from trainer.config.sections import Science


@torch.no_grad()
def evaluate(engine: Any, loader: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn: Loss) -> float:
    """Mean validation loss per sample over all ranks (one reduction of [sum, count])."""
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for inputs, targets in loader:
        totals[0] += loss_fn(engine(inputs), targets) * inputs.shape[0]
        totals[1] += inputs.shape[0]
    engine.train()
    torch_dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def science_scalars(
    engine: Any, volumes: VolumePair, science: Science, *, crop: int, norm: Normalization
) -> dict[str, float]:
    """The validation box (or its fixed sub-volume at the origin, ``science_box_size``, taken as periodic) predicted
    tiled as ``python -m model.predict`` does, and model.metrics' statistics of it as TensorBoard scalars: L1 per
    channel, and the power-spectrum ratio and r(k) per k range. One rank's work; the engine is back in training mode
    after it."""
    side = science.box_size or volumes.nbody.shape[1]
    micro = engine.train_micro_batch_size_per_gpu()
    metrics = compare_box(
        engine.module,
        volumes.nbody,
        volumes.hydro,
        norm=norm,
        crop=crop,
        batch=micro,
        device=engine.device,
        side=side,
    )
    engine.train()
    scalars = {"science/box_size": float(side)}
    scalars |= {f"science/l1_{name}": value for name, value in metrics["l1"].items()}
    # a k range with no shell the truth resolves has no median: nothing to log
    scalars |= {f"science/{name}": value for name, value in metrics["summary"].items() if value is not None}
    return scalars
