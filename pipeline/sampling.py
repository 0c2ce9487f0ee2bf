"""Which crop and which rotation each sample gets: pure functions of (seed, rank, epoch, index).

Every sample's draw comes from its own generator seeded by its coordinates, so a sample does not
depend on the samples before it: epochs replay exactly after a resume, and the DALI pipeline and
the numpy reference draw the same crops without sharing state. Training draws use the seed
``base_seed + global_rank`` so that ranks see different crops; validation draws ignore the rank
(each rank validates its share of one fixed set of crops).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.rotations import ROTATIONS, RotationArgs, VectorGroups, rotation_args
from pipeline.volumes import VolumePair

# Separates the validation stream from training epochs (SeedSequence entropy must be non-negative).
_VALIDATION_STREAM = 2**31 - 1


@dataclass(frozen=True)
class SampleDraw:
    corner: tuple[int, int, int]
    rotation: int
    """Index into ``ROTATIONS``; 0 is the identity."""


def _draw(entropy: tuple[int, ...], box_size: int, crop_size: int, *, rotate: bool) -> SampleDraw:
    rng = np.random.default_rng(entropy)
    corner = tuple(int(c) for c in rng.integers(0, box_size - crop_size + 1, size=3))
    rotation = int(rng.integers(len(ROTATIONS))) if rotate else 0
    return SampleDraw(corner, rotation)  # type: ignore[arg-type]


def train_draw(seed: int, epoch: int, index: int, *, box_size: int, crop_size: int, rotate: bool) -> SampleDraw:
    """Sample ``index`` of ``epoch`` for a rank whose seed is ``seed`` (base seed + global rank)."""
    return _draw((seed, epoch, index), box_size, crop_size, rotate=rotate)


def val_draw(seed: int, index: int, box_size: int, *, crop_size: int) -> SampleDraw:
    """Validation sample ``index`` (global over ranks), never rotated."""
    return _draw((seed, _VALIDATION_STREAM, index), box_size, crop_size, rotate=False)


@dataclass(frozen=True, kw_only=True)
class DrawPlan:
    """The samples one rank takes in an epoch, batch by batch: a pure function of config, rank and seed.

    Training plans draw with ``seed`` = base seed + global rank and a fresh set per epoch; validation
    plans draw from the rank-independent validation stream, indices ``first_index`` onwards, the same
    every epoch. The last batch is smaller when ``num_samples`` is not a multiple of ``batch_size``.
    """

    seed: int
    num_samples: int
    batch_size: int
    box_size: int
    crop_size: int
    rotate: bool
    validation: bool = False
    first_index: int = 0
    interleave: int = 1  # training batches from this many streams in turn: batch b is batch b // n of seed + b % n

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def batch_draws(self, epoch: int, batch: int) -> list[SampleDraw]:
        if self.validation:
            start = batch * self.batch_size
            indices = range(start, min(start + self.batch_size, self.num_samples))
            return [val_draw(self.seed, self.first_index + i, self.box_size, crop_size=self.crop_size) for i in indices]
        stream, batch = batch % self.interleave, batch // self.interleave
        start = batch * self.batch_size
        indices = range(start, min(start + self.batch_size, self.num_samples // self.interleave))
        seed = self.seed + stream
        return [
            train_draw(seed, epoch, i, box_size=self.box_size, crop_size=self.crop_size, rotate=self.rotate)
            for i in indices
        ]


@dataclass(frozen=True, kw_only=True)
class Augmenter:
    """The channel layout of inputs and targets, and the rotation arguments a draw implies for them."""

    in_channels: int
    out_channels: int
    in_vectors: VectorGroups
    out_vectors: VectorGroups

    def args(self, draw: SampleDraw) -> tuple[RotationArgs, RotationArgs]:
        rot = ROTATIONS[draw.rotation]
        return (
            rotation_args(rot, self.in_channels, self.in_vectors),
            rotation_args(rot, self.out_channels, self.out_vectors),
        )

    def reference(self, volumes: VolumePair, draw: SampleDraw, crop_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The numpy reference of one augmented sample, which every backend must reproduce exactly."""
        inputs = np.empty((self.in_channels,) + (crop_size,) * 3, dtype=np.float32)
        targets = np.empty((self.out_channels,) + (crop_size,) * 3, dtype=np.float32)
        volumes.cut(
            draw.corner,
            crop_size,
            ROTATIONS[draw.rotation],
            groups=(self.in_vectors, self.out_vectors),
            inputs=inputs,
            targets=targets,
        )
        return inputs, targets
