"""Predicting a whole periodic box with a network that sees crops: overlapping tiles, blended.

Tiles of the training crop size start every ``crop - overlap`` voxels along each axis and wrap
around the box (the simulations are periodic). Each tile's prediction is weighted by a window
that is 1 in the middle and falls off as sin^2 over ``overlap`` voxels at each face, where a U-Net
sees least context; adjacent windows then add up to 1, and the sum of all weights divides the sum
of the weighted predictions, so there are no seams. Input windows are read from the volume (an
array, a memory map or an h5py dataset) one tile at a time, and the two accumulators may live on
disk: memory is bounded by a batch of tiles, not by the box.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from model.unet import UNet


def tile_starts(box: int, crop: int, overlap: int) -> list[int]:
    """Tile corners along one axis: one tile when the box fits in a crop, else every crop - overlap voxels."""
    if not 0 <= overlap < crop:
        raise ValueError(f"overlap {overlap} must be in [0, crop {crop})")
    if box <= crop:
        return [0]
    stride = crop - overlap
    return [i * stride for i in range(math.ceil(box / stride))]


def window_1d(crop: int, overlap: int) -> np.ndarray:
    w = np.ones(crop, dtype=np.float64)
    if overlap:
        ramp = np.sin(0.5 * np.pi * (np.arange(overlap) + 0.5) / overlap) ** 2
        w[:overlap], w[crop - overlap :] = ramp, ramp[::-1]
    return w


def _runs(start: int, size: int, box: int) -> list[tuple[int, int, int]]:
    """(source start, source stop, destination start) runs covering [start, start + size) modulo box."""
    runs, done = [], 0
    while done < size:
        src = (start + done) % box
        n = min(size - done, box - src)
        runs.append((src, src + n, done))
        done += n
    return runs


def periodic_window(volume: Any, corner: tuple[int, int, int], size: int) -> np.ndarray:
    """The (C, size, size, size) window at ``corner`` of a periodic (C, L, L, L) volume, as float32."""
    box = volume.shape[1]
    out = np.empty((volume.shape[0], size, size, size), dtype=np.float32)
    for (a0, a1, da), (b0, b1, db), (c0, c1, dc) in itertools.product(*(_runs(c, size, box) for c in corner)):
        out[:, da : da + a1 - a0, db : db + b1 - b0, dc : dc + c1 - c0] = volume[:, a0:a1, b0:b1, c0:c1]
    return out


def _add_periodic(acc: np.ndarray, corner: tuple[int, int, int], block: np.ndarray) -> None:
    """acc[..., window at corner] += block, wrapping around the box."""
    box, size = acc.shape[-1], block.shape[-1]
    for (a0, a1, da), (b0, b1, db), (c0, c1, dc) in itertools.product(*(_runs(c, size, box) for c in corner)):
        acc[..., a0:a1, b0:b1, c0:c1] += block[..., da : da + a1 - a0, db : db + b1 - b0, dc : dc + c1 - c0]


def tiles(box: int, crop: int, overlap: int) -> Iterator[tuple[int, int, int]]:
    starts = tile_starts(box, crop, overlap)
    return itertools.product(starts, starts, starts)


@torch.no_grad()
def accumulate(
    model: UNet,
    volume: Any,
    crop: int,
    *,
    overlap: int,
    batch: int,
    device: torch.device,
    acc: np.ndarray,
    wsum: np.ndarray,
    progress: bool = False,
) -> None:
    """Add every tile's windowed prediction of the (C_in, L, L, L) periodic ``volume`` into ``acc``
    (C_out, L, L, L) and its window into ``wsum`` (L, L, L); the blend is ``acc / wsum``.

    Both may be memory maps (float64: the blend of one tile then reproduces its prediction exactly).
    """
    box = volume.shape[1]
    acc[...], wsum[...] = 0.0, 0.0
    w1 = window_1d(crop, overlap if box > crop else 0)
    window = w1[:, None, None] * w1[None, :, None] * w1[None, None, :]
    corners = list(tiles(box, crop, overlap))
    dtype = next(model.parameters()).dtype  # a model trained in fp16 or bf16 takes its inputs so
    model.eval()
    for first in tqdm(range(0, len(corners), batch), disable=not progress, desc="tiles", unit="batch"):
        group = corners[first : first + batch]
        inputs = torch.from_numpy(np.stack([periodic_window(volume, c, crop) for c in group])).to(device, dtype)
        predictions = model(inputs).double().cpu().numpy()
        for corner, prediction in zip(group, predictions, strict=True):
            _add_periodic(acc, corner, prediction * window)
            _add_periodic(wsum, corner, window)


def predict_box(
    model: UNet, volume: Any, out_channels: int, *, crop: int, overlap: int, batch: int, device: torch.device
) -> np.ndarray:
    """The blended prediction of a box that fits in memory, as (C_out, L, L, L) float32."""
    box = volume.shape[1]
    acc, wsum = np.zeros((out_channels, box, box, box)), np.zeros((box, box, box))
    accumulate(model, volume, crop, overlap=overlap, batch=batch, device=device, acc=acc, wsum=wsum)
    return (acc / wsum).astype(np.float32)
