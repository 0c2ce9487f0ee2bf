"""Predicting a whole periodic box with a network that sees crops: overlapping tiles, blended, a block of planes at a
time.

Tiles of the crop start every ``crop - overlap`` voxels along each axis and wrap around the box; each tile's
prediction is weighted by a window that is 1 in the middle and falls off as sin^2 over ``overlap`` voxels at each
face, and the blend divides the weighted sum by the windows' sum, a product of one sum per axis. The planes along x
come in blocks, one per row of tiles (the tiles that start at the same x); a block is final once the rows that
reach it are added, in the order of their index, whatever else is computed: so any split of the blocks (among ranks,
or a run resumed part way) gives the same values. docs/prediction.md says what this holds in memory.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

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
    return _periodic(volume, corner, (size, size, size))


def _periodic(volume: Any, corner: tuple[int, int, int], sizes: tuple[int, int, int]) -> np.ndarray:
    box = volume.shape[1:]
    out = np.empty((volume.shape[0], *sizes), dtype=np.float32)
    runs = [_runs(c, n, b) for c, n, b in zip(corner, sizes, box, strict=True)]
    for a0, a1, da in runs[0]:
        for b0, b1, db in runs[1]:
            for c0, c1, dc in runs[2]:
                out[:, da : da + a1 - a0, db : db + b1 - b0, dc : dc + c1 - c0] = volume[:, a0:a1, b0:b1, c0:c1]
    return out


@dataclass(frozen=True, kw_only=True)
class Tiling:
    """The tiles of a ``box``^3 periodic volume and the blocks of planes they make."""

    box: int
    crop: int
    overlap: int
    starts: list[int] = field(init=False)
    window: np.ndarray = field(init=False)  # the weight of one tile along an axis
    weights: np.ndarray = field(init=False)  # the windows' sum along an axis, over the whole box

    def __post_init__(self) -> None:
        starts = tile_starts(self.box, self.crop, self.overlap)
        window = window_1d(self.crop, self.overlap if self.box > self.crop else 0)
        weights = np.zeros(self.box)
        for start in starts:
            for s0, s1, d in _runs(start, self.crop, self.box):
                weights[s0:s1] += window[d : d + s1 - s0]
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "weights", weights)

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """The planes [start, stop) along x of each block: one per row of tiles, from its start to the next's."""
        ends = [*self.starts[1:], self.box]
        return list(zip(self.starts, ends, strict=True))

    def rows_reaching(self, block: int) -> list[int]:
        """The rows of tiles whose planes reach ``block``, by index."""
        lo, hi = self.blocks[block]
        planes = set(range(lo, hi))
        return [r for r, s in enumerate(self.starts) if planes & {(s + i) % self.box for i in range(self.crop)}]


@dataclass(kw_only=True)
class Timing:
    """Where a prediction's time went: the model, and waiting for the input rows or for the blend to catch up."""

    model_s: float = 0.0
    input_wait_s: float = 0.0
    output_wait_s: float = 0.0
    tiles: int = 0

    def as_dict(self, wall_s: float) -> dict[str, float]:
        return {
            "tiles": self.tiles,
            "wall_s": wall_s,
            "tiles_per_s": self.tiles / wall_s if wall_s else 0.0,
            "model_share": self.model_s / wall_s if wall_s else 0.0,
            "input_wait_share": self.input_wait_s / wall_s if wall_s else 0.0,
            "output_wait_share": self.output_wait_s / wall_s if wall_s else 0.0,
        }


@torch.no_grad()
def predict_blocks(
    model: UNet,
    volume: Any,
    tiling: Tiling,
    *,
    blocks: list[int],
    out_channels: int,
    batch: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
    timing: Timing | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """(block, its blended (C_out, planes, L, L) float32 prediction) for each of ``blocks``, as each is final.

    The rows that reach the blocks are taken in the order of their index; a row's input planes are read once, by a
    thread, while the row before is predicted, and the predictions are added into the blocks by another thread
    while the model runs. Held at once: a row's input and the next's, and the blocks that rows still reach."""
    timing = timing if timing is not None else Timing()
    dtype = dtype or next(model.parameters()).dtype  # a model trained in fp16 or bf16 takes its inputs so
    wanted = set(blocks)
    needs = {b: set(tiling.rows_reaching(b)) for b in wanted}
    rows = sorted(set().union(*needs.values())) if needs else []
    model.eval()
    open_blocks: dict[int, np.ndarray] = {}
    blender = _Blender(tiling, open_blocks, wanted, channels=out_channels)
    reader = _RowReader(volume, tiling, rows)
    try:
        for row, inputs in reader.rows(timing):
            yz = [(y, z) for y in tiling.starts for z in tiling.starts]
            for first in range(0, len(yz), batch):
                group = yz[first : first + batch]
                tiles = np.stack([_periodic(inputs, (0, y, z), (tiling.crop,) * 3) for y, z in group])
                start = time.perf_counter()
                predictions = model(torch.from_numpy(tiles).to(device, dtype)).float().cpu().numpy()
                timing.model_s += time.perf_counter() - start
                timing.tiles += len(group)
                blender.add(row, group, predictions, timing=timing)
            blender.wait(timing)
            for block in sorted(wanted):
                needs[block].discard(row)
                if not needs[block] and block in open_blocks:
                    wanted.discard(block)
                    yield block, blender.finish(block)
    finally:
        blender.close()
        reader.close()


class _RowReader:
    """Reads the input planes of each row in turn, one row ahead, in a thread of its own."""

    def __init__(self, volume: Any, tiling: Tiling, rows: list[int]) -> None:
        self.volume, self.tiling, self.rows_to_read = volume, tiling, rows
        self.ready: queue.Queue = queue.Queue(maxsize=1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, name="prediction rows", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        box = self.tiling.box
        for row in self.rows_to_read:
            if self.stop.is_set():
                return
            try:
                planes = _periodic(self.volume, (self.tiling.starts[row], 0, 0), (self.tiling.crop, box, box))
            except BaseException as err:  # said by the consumer, where it waits
                self.ready.put((row, err))
                return
            self.ready.put((row, planes))

    def rows(self, timing: Timing) -> Iterator[tuple[int, np.ndarray]]:
        for _ in self.rows_to_read:
            start = time.perf_counter()
            row, planes = self.ready.get()
            timing.input_wait_s += time.perf_counter() - start
            if isinstance(planes, BaseException):
                raise planes
            yield row, planes

    def close(self) -> None:
        self.stop.set()
        while self.thread.is_alive():
            try:
                self.ready.get_nowait()
            except queue.Empty:
                self.thread.join(timeout=0.05)


class _Blender:
    """Adds windowed tile predictions into the blocks they reach, in a thread of its own, in the order given."""

    def __init__(self, tiling: Tiling, blocks: dict[int, np.ndarray], wanted: set[int], *, channels: int) -> None:
        self.tiling, self.blocks, self.wanted, self.channels = tiling, blocks, wanted, channels
        w = tiling.window.astype(np.float32)
        self.window = w[:, None, None] * w[None, :, None] * w[None, None, :]
        self.work: queue.Queue = queue.Queue(maxsize=2)
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="prediction blend", daemon=True)
        self.thread.start()

    def add(self, row: int, corners: list[tuple[int, int]], predictions: np.ndarray, *, timing: Timing) -> None:
        start = time.perf_counter()
        self.work.put((row, corners, predictions))
        timing.output_wait_s += time.perf_counter() - start

    def wait(self, timing: Timing) -> None:
        start = time.perf_counter()
        self.work.join()
        timing.output_wait_s += time.perf_counter() - start
        if self.failed is not None:
            raise self.failed

    def _run(self) -> None:
        while True:
            item = self.work.get()
            try:
                if item is None:
                    return
                if self.failed is None:
                    self._add(*item)
            except BaseException as err:
                self.failed = err
            finally:
                self.work.task_done()

    def _add(self, row: int, corners: list[tuple[int, int]], predictions: np.ndarray) -> None:
        tiling, box, crop = self.tiling, self.tiling.box, self.tiling.crop
        for (y, z), prediction in zip(corners, predictions, strict=True):
            weighted = prediction * self.window
            for x0, x1, dx in _runs(tiling.starts[row], crop, box):
                for block in self.wanted:
                    lo, hi = tiling.blocks[block]
                    a, b = max(x0, lo), min(x1, hi)
                    if a >= b:
                        continue
                    if block not in self.blocks:
                        self.blocks[block] = np.zeros((self.channels, hi - lo, box, box), dtype=np.float32)
                    part = weighted[:, dx + a - x0 : dx + b - x0]
                    _add_yz(self.blocks[block][:, a - lo : b - lo], part, (y, z), box=box)

    def finish(self, block: int) -> np.ndarray:
        lo, hi = self.tiling.blocks[block]
        values = self.blocks.pop(block)
        weights = self.tiling.weights
        for plane, x in enumerate(range(lo, hi)):  # a plane's float64 weights at a time, not the block's
            values[:, plane] /= (weights[x] * weights[:, None] * weights[None, :]).astype(np.float32)
        return values

    def close(self) -> None:
        self.work.put(None)
        self.thread.join()


def _add_yz(target: np.ndarray, part: np.ndarray, corner: tuple[int, int], *, box: int) -> None:
    """target[:, :, window at (y, z)] += part, wrapping around the box in y and z."""
    size = part.shape[-1]
    for b0, b1, db in _runs(corner[0], size, box):
        for c0, c1, dc in _runs(corner[1], size, box):
            target[:, :, b0:b1, c0:c1] += part[:, :, db : db + b1 - b0, dc : dc + c1 - c0]


def predict_box(
    model: UNet,
    volume: Any,
    out_channels: int,
    *,
    crop: int,
    overlap: int,
    batch: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> np.ndarray:
    """The blended prediction of a box, as one (C_out, L, L, L) float32 array (for boxes that fit in memory)."""
    tiling = Tiling(box=volume.shape[1], crop=crop, overlap=overlap)
    out = np.empty((out_channels, tiling.box, tiling.box, tiling.box), dtype=np.float32)
    blocks = list(range(len(tiling.blocks)))
    found = predict_blocks(
        model, volume, tiling, blocks=blocks, out_channels=out_channels, batch=batch, device=device, dtype=dtype
    )
    for block, values in found:
        lo, hi = tiling.blocks[block]
        out[:, lo:hi] = values
    return out
