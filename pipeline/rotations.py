"""The 24 rotations of the cube, generated (not typed), and a numpy reference that applies them.

A rotation R is a signed permutation matrix with determinant +1: ``R[a, perm[a]] = signs[a]``.
Acting on a field sampled on a cube of voxels (coordinates centred on the cube), a scalar
channel moves with the grid, ``s'(R x) = s(x)``, and a vector field also turns its components,
``v'(R x) = R v(x)``. On the grid this is exact: transpose the spatial axes by ``perm``, reverse
the axes where ``signs`` is -1, and, for each vector (three channels holding the components
along the three spatial axes), output component ``a`` is ``signs[a]`` times input component
``perm[a]``. ``rotate_into`` here is the reference, and the CPU path; the device backends take
``RotationArgs`` and are tested against it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The six orderings of the spatial axes; DALI's transpose takes no per-sample permutation, so the
# DALI graph branches over these by index.
AXIS_PERMUTATIONS: tuple[tuple[int, int, int], ...] = tuple(itertools.permutations(range(3)))

VectorGroups = Sequence[Sequence[int]]


@dataclass(frozen=True)
class Rotation:
    """A proper rotation of the cube: output axis ``a`` is input axis ``perm[a]`` times ``signs[a]``."""

    perm: tuple[int, int, int]
    signs: tuple[int, int, int]

    @property
    def matrix(self) -> np.ndarray:
        m = np.zeros((3, 3), dtype=np.int64)
        for a in range(3):
            m[a, self.perm[a]] = self.signs[a]
        return m

    @property
    def perm_index(self) -> int:
        return AXIS_PERMUTATIONS.index(self.perm)


def _generate() -> tuple[Rotation, ...]:
    rotations = []
    for perm in AXIS_PERMUTATIONS:
        for signs in itertools.product((1, -1), repeat=3):
            rot = Rotation(perm, signs)
            if round(np.linalg.det(rot.matrix)) == 1:
                rotations.append(rot)
    return tuple(rotations)


# Index 0 is the identity (the first permutation with all signs +1).
ROTATIONS: tuple[Rotation, ...] = _generate()


def check_vector_groups(groups: VectorGroups, num_channels: int) -> None:
    """Each vector is three distinct channel indices in range; channels belong to one vector at most."""
    seen: set[int] = set()
    for group in groups:
        if len(group) != 3:
            raise ValueError(f"a vector needs 3 channels (along x, y, z), got {list(group)}")
        for c in group:
            if not 0 <= c < num_channels:
                raise ValueError(f"vector channel {c} is out of range for {num_channels} channels")
            if c in seen:
                raise ValueError(f"channel {c} appears in more than one vector")
            seen.add(c)


def channel_order(perm: Sequence[int], num_channels: int, groups: VectorGroups) -> tuple[int, ...]:
    """Input channel feeding each output channel under the axis permutation ``perm``."""
    order = list(range(num_channels))
    for group in groups:
        for a in range(3):
            order[group[a]] = group[perm[a]]
    return tuple(order)


def channel_signs(rot: Rotation, num_channels: int, groups: VectorGroups) -> np.ndarray:
    """Sign applied to each output channel: ``signs[a]`` on vector component ``a``, +1 elsewhere."""
    sign = np.ones(num_channels, dtype=np.float32)
    for group in groups:
        for a in range(3):
            sign[group[a]] = rot.signs[a]
    return sign


@dataclass(frozen=True)
class RotationArgs:
    """Per-sample arguments that a backend needs to apply one rotation to one (C, D, H, W) tensor."""

    perm_index: int
    flips: np.ndarray  # (3,) int32: reverse spatial axis a (after the transpose) where 1
    sign: np.ndarray  # (C, 1, 1, 1) float32: multiplies each output channel


def rotation_args(rot: Rotation, num_channels: int, groups: VectorGroups) -> RotationArgs:
    return RotationArgs(
        perm_index=rot.perm_index,
        flips=np.array([s < 0 for s in rot.signs], dtype=np.int32),
        sign=channel_signs(rot, num_channels, groups).reshape(num_channels, 1, 1, 1),
    )


_CHUNK = 16


def rotate_into(x: np.ndarray, rot: Rotation, groups: VectorGroups, *, out: np.ndarray) -> np.ndarray:
    """Write ``x`` (C, D, H, W) rotated by ``rot`` into ``out``, in one pass: the reference implementation.

    ``x`` may be any strided view (a crop window of a larger volume, a transposed memory map): the
    transpose and flips are strides of a view, so each output channel is one copy from its source
    channel, negated where the rotation reverses that vector component.
    """
    view = np.transpose(x, (0, *(1 + p for p in rot.perm)))
    view = np.flip(view, axis=tuple(1 + a for a in range(3) if rot.signs[a] < 0))
    order = channel_order(rot.perm, x.shape[0], groups)
    sign = channel_signs(rot, x.shape[0], groups)
    # Where the innermost output axis reads an outer input axis, each output row strides through many planes of
    # the input; cut along that axis in chunks of 16 voxels, the copy reads a few planes at a time (about 1.5x faster
    # at 64^3 on a 2-core EPYC machine; (0, 2, 1) is faster whole).
    size = x.shape[3]
    chunk = _CHUNK if rot.perm[2] != 2 and rot.perm != (0, 2, 1) else size
    for c in range(x.shape[0]):
        for k in range(0, size, chunk):
            src, dst = view[order[c], ..., k : k + chunk], out[c, ..., k : k + chunk]
            if sign[c] > 0:
                np.copyto(dst, src)
            else:
                np.negative(src, out=dst)
    return out
