"""Batches of crops cut on CPU threads, ahead of the consumer: the source of both backends.

On a CPU one strided numpy copy cuts, transposes, flips and negates a crop at once, where DALI's CPU operators
take several passes and its worker processes add a copy through shared memory (measured: docs/data.md). So the CPU
cuts crops here, on threads (numpy and h5py release the GIL for their copies), and rotates them in the same copy
when training runs on the CPU; when it runs on a GPU, it leaves the rotation to the device and returns its
arguments with the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.rotations import ROTATIONS
from pipeline.sampling import Augmenter, DrawPlan, SampleDraw
from pipeline.volumes import VolumePair


@dataclass(kw_only=True)
class CropBatch:
    """One batch, as views of a reusable buffer: valid until the buffer comes round again."""

    inputs: np.ndarray  # (n, C_in, S, S, S) float32; channels last in memory when channels_last
    targets: np.ndarray  # (n, C_out, S, S, S) float32
    draws: list[SampleDraw]
    rotated: bool  # False: the rotation of each draw is still to be applied
    slot: int  # which buffer of the batcher's ring holds it
    channels_last: bool = False

    def contiguous(self) -> tuple[np.ndarray, np.ndarray, str]:
        """The buffers as they lie in memory, C-contiguous, and their per-sample layout (CDHW or DHWC)."""
        if self.channels_last:
            return self.inputs.transpose(0, 2, 3, 4, 1), self.targets.transpose(0, 2, 3, 4, 1), "DHWC"
        return self.inputs, self.targets, "CDHW"


class Guard(Protocol):
    """Work still reading a buffer, asynchronously (a CUDA event after a copy from it)."""

    def synchronize(self) -> None: ...


def ring_slots(lookahead: int, hold: int) -> int:
    """Buffers in a batcher's ring: the batches cut ahead, those the consumer holds, and the one being read."""
    return lookahead + hold + 1


class CropBatcher:
    """Cuts the batches of ``plan`` from ``volumes`` with ``threads`` threads, ``lookahead`` batches ahead.

    ``get(epoch, batch)`` returns that batch (waiting if need be) from a ring of buffers, of which the consumer may
    hold ``hold``; a buffer read asynchronously (a copy to the GPU) is cut into again once its ``guard`` synchronized.
    """

    def __init__(
        self,
        volumes: VolumePair,
        plan: DrawPlan,
        augmenter: Augmenter,
        *,
        rotate_here: bool,
        threads: int,
        lookahead: int = 2,
        hold: int = 1,
        channels_last: bool = False,
        allocate: Callable[[tuple[int, ...]], np.ndarray] = lambda shape: np.empty(shape, np.float32),
    ) -> None:
        self.volumes, self.plan, self.augmenter = volumes, plan, augmenter
        self.rotate_here = rotate_here
        self.lookahead = lookahead
        self.channels_last = channels_last
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="crops")
        self._allocate = allocate
        self._guards: dict[int, Guard] = {}
        self._ring = [
            (self._buffer(augmenter.in_channels), self._buffer(augmenter.out_channels))
            for _ in range(ring_slots(lookahead, hold))
        ]
        self._next_slot = 0
        self._pending: dict[tuple[int, int], tuple[int, list[SampleDraw], list[Future]]] = {}

    @property
    def nbytes(self) -> int:
        """Host memory of the ring of buffers (allocated up front)."""
        return sum(a.nbytes for pair in self._ring for a in pair)

    def _buffer(self, channels: int) -> np.ndarray:
        """(batch, C, S, S, S), laid out as (batch, S, S, S, C) in memory when channels_last."""
        batch, size = self.plan.batch_size, self.plan.crop_size
        if self.channels_last:
            return self._allocate((batch, size, size, size, channels)).transpose(0, 4, 1, 2, 3)
        return self._allocate((batch, channels, size, size, size))

    def _following(self, epoch: int, batch: int) -> tuple[int, int]:
        return (epoch, batch + 1) if batch + 1 < self.plan.num_batches else (epoch + 1, 0)

    def _submit(self, key: tuple[int, int]) -> None:
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._ring)
        guard = self._guards.pop(slot, None)
        if guard is not None:  # an asynchronous read of this buffer may still be under way
            guard.synchronize()
        draws = self.plan.batch_draws(*key)
        inputs, targets = self._ring[slot]
        futures = [self._pool.submit(self._cut, draw, inputs[j], targets[j]) for j, draw in enumerate(draws)]
        self._pending[key] = (slot, draws, futures)

    def _cut(self, draw: SampleDraw, inputs: np.ndarray, targets: np.ndarray) -> None:
        if self.rotate_here:
            groups = (self.augmenter.in_vectors, self.augmenter.out_vectors)
            self.volumes.cut(
                draw.corner,
                self.plan.crop_size,
                ROTATIONS[draw.rotation],
                groups=groups,
                inputs=inputs,
                targets=targets,
            )
        else:
            self.volumes.read_crop(draw.corner, self.plan.crop_size, inputs, targets=targets)

    def get(self, epoch: int, batch: int) -> CropBatch:
        key = (epoch, batch)
        if key not in self._pending:  # not foreseen (a first call, or a jump): start afresh
            for _, _, futures in self._pending.values():
                for future in futures:
                    future.result()
            self._pending.clear()
            self._submit(key)
        ahead = key
        for _ in range(self.lookahead):
            ahead = self._following(*ahead)
            if ahead not in self._pending:
                self._submit(ahead)
        slot, draws, futures = self._pending.pop(key)
        for future in futures:
            future.result()  # re-raises a worker's exception here
        inputs, targets = self._ring[slot]
        n = len(draws)
        return CropBatch(
            inputs=inputs[:n],
            targets=targets[:n],
            draws=draws,
            rotated=self.rotate_here,
            channels_last=self.channels_last,
            slot=slot,
        )

    def guard(self, batch: CropBatch, guard: Guard) -> None:
        """``batch``'s buffer is read asynchronously until ``guard`` synchronizes: not to be cut into before."""
        self._guards[batch.slot] = guard

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
