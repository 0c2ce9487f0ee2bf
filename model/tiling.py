"""Where the tiles of a box go, what they read, and how their predictions are blended.

A box of any shape (L1 x L2 x L3) is covered by tiles of the crop, every ``crop - overlap`` voxels along each axis.
Along a periodic axis the tiles start at 0 and wrap around; along one that is not (``mirror``: a sub-volume, a slab of
a larger run) they start ``pad`` voxels before the face and read the box's mirror image beyond it. Each tile's
prediction is weighted (``Blend``, named and versioned) and the blend divides by the weights' sum. The planes along x
come in blocks, one per row of tiles (``model/blocks.py`` predicts them). docs/prediction.md says why and measures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np

BOUNDARIES = ("periodic", "mirror")


def default_overlap(crop: int) -> int:
    """The voxels tiles overlap by unless told otherwise: a quarter of the crop."""
    return crop // 4


def default_pad(crop: int) -> int:
    """The mirrored context before a face that is not periodic: an eighth of the crop (measured, docs/prediction.md)."""
    return crop // 8


@dataclass(frozen=True, kw_only=True)
class Axis:
    """One axis of a box: its size, whether it wraps, and where its tiles start (negative: before the first face)."""

    size: int
    crop: int
    overlap: int
    periodic: bool
    pad: int = 0

    @cached_property
    def starts(self) -> list[int]:
        stride = self.crop - self.overlap
        if self.periodic:
            return [0] if self.size <= self.crop else [i * stride for i in range(math.ceil(self.size / stride))]
        span = self.size + 2 * self.pad  # the box and the mirrored context either side
        count = 1 if span <= self.crop else math.ceil((span - self.crop) / stride) + 1
        return [i * stride - self.pad for i in range(count)]

    def placed(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """(box start, box stop, offset in the tile) runs where a tile's voxels [start, start + length) land: wrapped
        around a periodic axis, cut at the faces of one that is not."""
        if not self.periodic:
            lo, hi = max(start, 0), min(start + length, self.size)
            return [(lo, hi, lo - start)] if lo < hi else []
        runs, done = [], 0
        while done < length:
            source = (start + done) % self.size
            n = min(length - done, self.size - source)
            runs.append((source, source + n, done))
            done += n
        return runs

    def sources(self, start: int, length: int) -> list[tuple[int, int, int, bool]]:
        """(box start, box stop, offset, mirrored) runs that voxels [start, start + length) are read from: wrapped,
        or the mirror image about each face (a mirrored run is read backwards)."""
        if self.periodic:
            return [(lo, hi, offset, False) for lo, hi, offset in self.placed(start, length)]
        runs, done, period = [], 0, 2 * self.size
        while done < length:
            folded = (start + done) % period
            mirrored = folded >= self.size
            position = period - 1 - folded if mirrored else folded
            n = min(length - done, position + 1 if mirrored else self.size - position)
            runs.append(
                (position - n + 1, position + 1, done, True) if mirrored else (position, position + n, done, False)
            )
            done += n
        return runs

    @property
    def extent(self) -> tuple[int, int]:
        """The voxels [first, stop) the tiles along this axis read, in box coordinates."""
        return self.starts[0], self.starts[-1] + self.crop


class Blend(Protocol):
    """How tile predictions are weighted: ``name`` (with its version: part of a prediction's resume key), the
    weight of each voxel of a tile, and the weights' sum over a plane of the box, which the blend divides by."""

    name: str

    def tile(self) -> np.ndarray: ...

    def plane(self, x: int) -> np.ndarray: ...


def window_1d(crop: int, overlap: int) -> np.ndarray:
    """1 in the middle, rising as sin^2 over ``overlap`` voxels at each end."""
    w = np.ones(crop, dtype=np.float64)
    if overlap:
        ramp = np.sin(0.5 * np.pi * (np.arange(overlap) + 0.5) / overlap) ** 2
        w[:overlap], w[crop - overlap :] = ramp, ramp[::-1]
    return w


class SineBlend:
    """sin^2 ramps over the overlap at each face of a tile (none along an axis of one tile), a product over the
    axes; so the sum of the weights is a product of one sum per axis, float64."""

    name = "sin2/1"

    def __init__(self, tiling: Tiling) -> None:
        self.windows = [window_1d(a.crop, a.overlap if len(a.starts) > 1 else 0) for a in tiling.axes]
        self.sums = []
        for axis, window in zip(tiling.axes, self.windows, strict=True):
            total = np.zeros(axis.size)
            for start in axis.starts:
                for lo, hi, offset in axis.placed(start, axis.crop):
                    total[lo:hi] += window[offset : offset + hi - lo]
            self.sums.append(total)

    def tile(self) -> np.ndarray:
        wx, wy, wz = (w.astype(np.float32) for w in self.windows)
        return wx[:, None, None] * wy[None, :, None] * wz[None, None, :]

    def plane(self, x: int) -> np.ndarray:
        return (self.sums[0][x] * self.sums[1][:, None] * self.sums[2][None, :]).astype(np.float32)


BLENDS = {SineBlend.name: SineBlend}


@dataclass(frozen=True, kw_only=True)
class Tiling:
    """The tiles of a box of ``shape`` (periodic or mirrored along each axis) and the blocks of planes they make."""

    shape: tuple[int, int, int]
    crop: int
    overlap: int
    periodic: tuple[bool, bool, bool] = (True, True, True)
    pad: int = 0  # along an axis that is not periodic: the voxels of mirrored context before each face
    blend: str = SineBlend.name
    vectors: tuple[tuple[int, int, int], ...] = ()  # vector channels to turn in a mirror image (measured worse: off)

    def __post_init__(self) -> None:
        if not 0 <= self.overlap < self.crop:
            raise ValueError(f"overlap {self.overlap} must be in [0, {self.crop}) for {self.crop}^3 tiles")
        if not 0 <= self.pad <= self.crop:
            raise ValueError(f"pad {self.pad} must be in [0, {self.crop}] for {self.crop}^3 tiles")
        if self.blend not in BLENDS:
            raise ValueError(f"no blend {self.blend!r} (known: {', '.join(BLENDS)})")

    @cached_property
    def axes(self) -> tuple[Axis, Axis, Axis]:
        return tuple(
            Axis(size=n, crop=self.crop, overlap=self.overlap, periodic=p, pad=0 if p else self.pad)
            for n, p in zip(self.shape, self.periodic, strict=True)
        )

    @cached_property
    def blending(self) -> Blend:
        return BLENDS[self.blend](self)

    @property
    def starts(self) -> list[int]:
        """Where the rows of tiles start along x."""
        return self.axes[0].starts

    @cached_property
    def blocks(self) -> list[tuple[int, int]]:
        """The planes [start, stop) along x of each block: from a row's start inside the box to the next one's."""
        cuts = sorted({s for s in self.starts if 0 < s < self.shape[0]})
        return list(zip([0, *cuts], [*cuts, self.shape[0]], strict=True))

    def rows_reaching(self, block: int) -> list[int]:
        """The rows of tiles whose planes reach ``block``, by index."""
        lo, hi = self.blocks[block]
        axis = self.axes[0]
        return [r for r, s in enumerate(self.starts) if any(a < hi and b > lo for a, b, _ in axis.placed(s, self.crop))]

    def describe(self) -> dict[str, Any]:
        """What decides the values: part of a prediction's resume key and of its attributes."""
        boundary = ["periodic" if p else "mirror" for p in self.periodic]
        return {
            "shape": list(self.shape),
            "crop": self.crop,
            "overlap": self.overlap,
            "boundary": boundary,
            "pad": self.pad,
            "blend": self.blend,
        }

    def read(self, volume: Any, corner: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """The (C, *sizes) float32 block at ``corner`` (box coordinates, maybe outside the box) of a (C, L1, L2, L3)
        volume: wrapped along periodic axes, mirrored about the faces of the others (the components of ``vectors``
        along a mirrored axis negated)."""
        out = np.empty((volume.shape[0], *sizes), dtype=np.float32)
        runs = [a.sources(c, n) for a, c, n in zip(self.axes, corner, sizes, strict=True)]
        for a0, a1, da, ma in runs[0]:
            for b0, b1, db, mb in runs[1]:
                for c0, c1, dc, mc in runs[2]:
                    part = np.asarray(volume[:, a0:a1, b0:b1, c0:c1])
                    flips = tuple(axis for axis, m in zip((1, 2, 3), (ma, mb, mc), strict=True) if m)
                    target = out[:, da : da + a1 - a0, db : db + b1 - b0, dc : dc + c1 - c0]
                    target[...] = np.flip(part, axis=flips) if flips else part
                    for group in self.vectors:
                        for axis, m in enumerate((ma, mb, mc)):
                            if m:
                                target[group[axis]] *= -1
        return out
