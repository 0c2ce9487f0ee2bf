"""The science metrics of a model on a box with its truth, computed alike by validation during training and by the
prediction command: the box tiled as ``model.predict`` tiles it, the prediction kept on disk a block at a time, and
``model.metrics.compare`` reading it back a slab at a time."""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import torch

from model.blocks import predict_volume
from model.metrics import Normalization, compare
from model.tiling import Tiling, default_overlap


class Origin:
    """The ``side``^3 sub-volume at the origin of a (C, L, L, L) volume, read through as a volume of its own."""

    def __init__(self, volume: Any, side: int) -> None:
        self.volume, self.shape, self.ndim = volume, (volume.shape[0], side, side, side), 4

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        key = key[1:] if key and key[0] is Ellipsis else key
        key = key + (slice(None),) * (4 - len(key))
        inside = tuple(
            k if isinstance(k, (int, np.integer)) else slice(*k.indices(n))
            for k, n in zip(key, self.shape, strict=True)
        )
        return np.asarray(self.volume[inside])


def compare_box(
    model: torch.nn.Module,
    nbody: Any,
    hydro: Any,
    *,
    norm: Normalization,
    crop: int,
    batch: int,
    device: torch.device,
    side: int | None = None,
) -> dict:
    """``compare``'s metrics of the model's prediction of a box against its truth: the whole box, or the fixed
    ``side``^3 sub-volume at its origin taken as periodic, tiled as ``model.predict`` tiles by default. The
    prediction is written to a temporary file block by block: memory stays at the evaluation's few fields."""
    side = side or nbody.shape[1]
    inputs, truth = (volume if side == volume.shape[1] else Origin(volume, side) for volume in (nbody, hydro))
    tiling = Tiling(shape=(side,) * 3, crop=crop, overlap=default_overlap(crop))
    channels = hydro.shape[0]
    with tempfile.TemporaryDirectory(prefix="science-") as scratch:
        pred = np.lib.format.open_memmap(
            f"{scratch}/pred.npy", mode="w+", dtype=np.float32, shape=(channels, *(side,) * 3)
        )
        predict_volume(model, inputs, tiling, out=pred, batch=batch, device=device)
        pred.flush()
        metrics = compare(pred, truth, norm)
        del pred
    return metrics
