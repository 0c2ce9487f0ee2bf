"""Predicting the blocks of a tiling: each row of tiles read once, the model run on its tiles in batches, and the
predictions blended into the blocks they reach.

A block is final once the rows that reach it are added, in the order of their index, whatever else is computed: so
any split of the blocks (among ranks, or a run resumed part way) gives the same values. The reading and the blending
run in threads of their own while the model runs; docs/prediction.md says what this holds in memory.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from model.tiling import Tiling


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
    model: torch.nn.Module,
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
    """(block, its blended (C_out, planes, L2, L3) float32 prediction) for each of ``blocks``, as each is final.

    Held at once: a row's input and the next's, and the blocks that rows still reach."""
    timing = timing if timing is not None else Timing()
    dtype = dtype or next(model.parameters()).dtype  # a model trained in fp16 or bf16 takes its inputs so
    wanted = set(blocks)
    needs = {b: set(tiling.rows_reaching(b)) for b in wanted}
    rows = sorted(set().union(*needs.values())) if needs else []
    model.eval()
    open_blocks: dict[int, np.ndarray] = {}
    blender = _Blender(tiling, open_blocks, wanted, channels=out_channels)
    reader = _RowReader(volume, tiling, rows)
    (y0, _), (z0, _) = tiling.axes[1].extent, tiling.axes[2].extent
    crop = tiling.crop
    try:
        for row, inputs in reader.rows(timing):
            yz = [(y, z) for y in tiling.axes[1].starts for z in tiling.axes[2].starts]
            for first in range(0, len(yz), batch):
                group = yz[first : first + batch]
                tiles = np.stack([inputs[:, :, y - y0 : y - y0 + crop, z - z0 : z - z0 + crop] for y, z in group])
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


def predict_volume(
    model: torch.nn.Module, volume: Any, tiling: Tiling, *, out: Any, batch: int, device: torch.device
) -> None:
    """The blended prediction of the whole box into ``out``: an array, a memory map or a dataset of its shape."""
    blocks = list(range(len(tiling.blocks)))
    found = predict_blocks(model, volume, tiling, blocks=blocks, out_channels=out.shape[0], batch=batch, device=device)
    for block, values in found:
        lo, hi = tiling.blocks[block]
        out[:, lo:hi] = values


class _RowReader:
    """Reads the input planes of each row in turn, one row ahead, in a thread of its own."""

    def __init__(self, volume: Any, tiling: Tiling, rows: list[int]) -> None:
        self.volume, self.tiling, self.rows_to_read = volume, tiling, rows
        self.ready: queue.Queue = queue.Queue(maxsize=1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, name="prediction rows", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        (y0, y1), (z0, z1) = self.tiling.axes[1].extent, self.tiling.axes[2].extent
        for row in self.rows_to_read:
            if self.stop.is_set():
                return
            try:
                corner = (self.tiling.starts[row], y0, z0)
                planes = self.tiling.read(self.volume, corner, (self.tiling.crop, y1 - y0, z1 - z0))
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
    """Adds weighted tile predictions into the blocks they reach, in a thread of its own, in the order given."""

    def __init__(self, tiling: Tiling, blocks: dict[int, np.ndarray], wanted: set[int], *, channels: int) -> None:
        self.tiling, self.blocks, self.wanted, self.channels = tiling, blocks, wanted, channels
        self.weights = tiling.blending.tile()
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
        tiling, crop = self.tiling, self.tiling.crop
        x_axis, y_axis, z_axis = tiling.axes
        for (y, z), prediction in zip(corners, predictions, strict=True):
            weighted = prediction * self.weights
            for x0, x1, dx in x_axis.placed(tiling.starts[row], crop):
                for block in self.wanted:
                    lo, hi = tiling.blocks[block]
                    a, b = max(x0, lo), min(x1, hi)
                    if a >= b:
                        continue
                    if block not in self.blocks:
                        shape = (self.channels, hi - lo, *tiling.shape[1:])
                        self.blocks[block] = np.zeros(shape, dtype=np.float32)
                    part = weighted[:, dx + a - x0 : dx + b - x0]
                    target = self.blocks[block][:, a - lo : b - lo]
                    for b0, b1, db in y_axis.placed(y, crop):
                        for c0, c1, dc in z_axis.placed(z, crop):
                            target[:, :, b0:b1, c0:c1] += part[:, :, db : db + b1 - b0, dc : dc + c1 - c0]

    def finish(self, block: int) -> np.ndarray:
        lo, hi = self.tiling.blocks[block]
        values = self.blocks.pop(block)
        for plane, x in enumerate(range(lo, hi)):  # a plane's weights at a time, not the block's
            values[:, plane] /= self.tiling.blending.plane(x)
        return values

    def close(self) -> None:
        self.work.put(None)
        self.thread.join()
