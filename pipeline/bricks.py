"""Volumes stored as bricks: a (C, L, L, L) volume as an array (L/b, L/b, L/b, C, b, b, b), every channel of a b^3
brick in one contiguous run, so that a crop reads the few bricks it overlaps in as many runs (27 of 32^3 for a 64^3
crop), where a (C, L, L, L) file takes thousands of short runs. Written by ``pipeline.convert --layout bricks``."""

from __future__ import annotations

from typing import Any

import numpy as np


def to_bricks(volume: Any, brick: int) -> np.ndarray:
    """A (C, X, Y, Z) array as bricks (X/b, Y/b, Z/b, C, b, b, b), a new array; its sides multiples of ``brick``."""
    channels, *sides = volume.shape
    x, y, z = (side // brick for side in sides)
    return np.ascontiguousarray(
        np.asarray(volume).reshape(channels, x, brick, y, brick, z, brick).transpose(1, 3, 5, 0, 2, 4, 6)
    )


class Bricks:
    """A bricked array read as the (C, L, L, L) volume it holds: ``volume[c]``, ``volume[...]`` and windows of unit-step
    slices (or single indices) return new arrays, assembled from the bricks they overlap."""

    ndim = 4

    def __init__(self, array: np.ndarray) -> None:
        nx, ny, nz, channels, brick, *_ = array.shape
        self.array, self.brick, self.dtype = array, brick, array.dtype
        self.shape = (channels, nx * brick, ny * brick, nz * brick)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[...]
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def _ranges(self, key: Any) -> tuple[list[tuple[int, int] | int], ...]:
        key = key if isinstance(key, tuple) else (key,)
        if key and key[0] is Ellipsis:
            key = key[1:]
        key = key + (slice(None),) * (4 - len(key))
        ranges: list[tuple[int, int] | int] = []
        for axis, part in enumerate(key):
            if isinstance(part, (int, np.integer)):
                ranges.append(int(part))
                continue
            start, stop, step = part.indices(self.shape[axis])
            if step != 1:
                raise IndexError("bricks are read with unit steps only")
            ranges.append((start, stop))
        return tuple(ranges)

    def __getitem__(self, key: Any) -> np.ndarray:
        c, *spatial = self._ranges(key)
        channels = slice(c, c + 1) if isinstance(c, int) else slice(*c)
        bounds = [(r, r + 1) if isinstance(r, int) else r for r in spatial]
        out = np.empty((channels.stop - channels.start, *(b - a for a, b in bounds)), dtype=self.dtype)
        b = self.brick
        (x0, x1), (y0, y1), (z0, z1) = bounds
        for bx in range(x0 // b, (x1 - 1) // b + 1):
            xa, xb = max(x0, bx * b), min(x1, bx * b + b)
            for by in range(y0 // b, (y1 - 1) // b + 1):
                ya, yb = max(y0, by * b), min(y1, by * b + b)
                for bz in range(z0 // b, (z1 - 1) // b + 1):
                    za, zb = max(z0, bz * b), min(z1, bz * b + b)
                    brick = self.array[bx, by, bz, channels]
                    out[:, xa - x0 : xb - x0, ya - y0 : yb - y0, za - z0 : zb - z0] = brick[
                        :, xa - bx * b : xb - bx * b, ya - by * b : yb - by * b, za - bz * b : zb - bz * b
                    ]
        drop = tuple(i for i, r in enumerate((c, *spatial)) if isinstance(r, int))
        return out.squeeze(axis=drop) if drop else out
