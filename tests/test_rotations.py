import itertools

import numpy as np
import pytest

from pipeline.rotations import ROTATIONS, Rotation, check_vector_groups, rotate_into

VEC = [[1, 2, 3]]


def rotation_from_matrix(m: np.ndarray) -> Rotation:
    """The table entry whose matrix is ``m`` (raises ValueError for anything else)."""
    for rot in ROTATIONS:
        if np.array_equal(rot.matrix, m):
            return rot
    raise ValueError(f"not a rotation of the cube: {m.tolist()}")


def rotate_volume(x: np.ndarray, rot: Rotation, groups) -> np.ndarray:
    """``x`` (C, D, H, W) rotated by ``rot`` into a new array."""
    return rotate_into(x, rot, groups, out=np.empty(x.shape, dtype=x.dtype))


def test_there_are_24_distinct_proper_rotations():
    matrices = [r.matrix for r in ROTATIONS]
    assert len(matrices) == 24
    assert len({m.tobytes() for m in matrices}) == 24
    for m in matrices:
        assert round(np.linalg.det(m)) == 1
        assert np.array_equal(m @ m.T, np.eye(3, dtype=int))  # orthogonal: a signed permutation
    assert np.array_equal(ROTATIONS[0].matrix, np.eye(3, dtype=int))


def test_closed_under_composition_and_inverse():
    for a, b in itertools.product(ROTATIONS, repeat=2):
        rotation_from_matrix(a.matrix @ b.matrix)  # raises if the product is not in the table
    for a in ROTATIONS:
        rotation_from_matrix(a.matrix.T)


def _centred_grid(n: int) -> np.ndarray:
    """(3, n, n, n): the coordinates of each voxel centre, measured from the centre of the cube."""
    c = np.arange(n) - (n - 1) / 2
    return np.stack(np.meshgrid(c, c, c, indexing="ij"))


def test_voxel_moves_to_rotated_position():
    n = 5
    for rot in ROTATIONS:
        x = np.zeros((1, n, n, n), dtype=np.float32)
        x[0, 4, 1, 0] = 1.0
        y = rotate_volume(x, rot, [])
        pos = np.argwhere(y[0] == 1.0)[0] - (n - 1) / 2
        assert np.array_equal(pos, rot.matrix @ (np.array([4, 1, 0]) - (n - 1) / 2))


def test_constant_velocity_along_x_points_where_the_rotation_sends_x():
    n = 4
    for rot in ROTATIONS:
        x = np.zeros((4, n, n, n), dtype=np.float32)
        x[0] = np.random.default_rng(0).random((n, n, n))  # a scalar channel, rotated but not turned
        x[1] = 1.0  # vx = 1, vy = vz = 0
        y = rotate_volume(x, rot, VEC)
        expected = rot.matrix @ np.array([1, 0, 0])
        for a in range(3):
            assert np.all(y[1 + a] == expected[a])


def test_position_field_is_invariant():
    # v(r) = r is carried onto itself by every rotation: checks that the grid and the components turn together.
    n = 6
    r = _centred_grid(n).astype(np.float32)
    x = np.concatenate([np.zeros((1, n, n, n), np.float32), r])
    for rot in ROTATIONS:
        assert np.array_equal(rotate_volume(x, rot, VEC), x)


def test_rotate_volume_is_a_group_action():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 4, 4, 4)).astype(np.float32)
    groups = [[1, 2, 3], [6, 4, 5]]  # two vectors, the second with its components out of order
    for a, b in itertools.product(ROTATIONS, repeat=2):
        composed = rotation_from_matrix(b.matrix @ a.matrix)
        assert np.array_equal(rotate_volume(rotate_volume(x, a, groups), b, groups), rotate_volume(x, composed, groups))


@pytest.mark.parametrize(
    "groups, message",
    [([[1, 2]], "needs 3 channels"), ([[1, 2, 9]], "out of range"), ([[1, 2, 3], [3, 4, 5]], "more than one vector")],
)
def test_bad_vector_groups_are_named(groups, message):
    with pytest.raises(ValueError, match=message):
        check_vector_groups(groups, 6)


def test_files_stored_in_zyx_order_declare_their_vectors_reversed():
    """A box stored with its spatial axes in (z, y, x) order and channels [rho, vx, vy, vz] has vz along array axis 1:
    input_vectors [[3, 2, 1]] turns its velocities exactly as [[1, 2, 3]] turns the same box stored in (x, y, z)."""
    rng = np.random.default_rng(1)
    xyz = rng.normal(size=(4, 6, 6, 6)).astype(np.float32)
    zyx = np.ascontiguousarray(xyz.transpose(0, 3, 2, 1))  # the same fields, spatial axes reversed
    swap = np.array([[0, 0, 1], [0, 1, 0], [1, 0, 0]])  # x <-> z: the same rotation seen in the other array order
    wrong = 0
    for rot in ROTATIONS:
        seen_zyx = rotation_from_matrix(swap @ rot.matrix @ swap)
        expected = rotate_volume(xyz, rot, [[1, 2, 3]]).transpose(0, 3, 2, 1)
        assert np.array_equal(rotate_volume(zyx, seen_zyx, [[3, 2, 1]]), expected)
        wrong += not np.array_equal(rotate_volume(zyx, seen_zyx, [[1, 2, 3]]), expected)
    # Declared in (x, y, z) order, they turn wrongly under every rotation but the 4 that commute with the swap.
    assert wrong == 24 - sum(np.array_equal(swap @ r.matrix, r.matrix @ swap) for r in ROTATIONS) == 20


def test_the_chunked_copy_equals_the_whole_view():
    """rotate_into copies some rotations in chunks along the innermost axis (cache-friendlier): every voxel of a
    box larger than, and not a multiple of, the chunk lands where the plain transposed, flipped view puts it."""
    rng = np.random.default_rng(3)
    box = rng.normal(size=(5, 37, 37, 37)).astype(np.float32)
    window = box[:, 1:36, 2:37, 0:35]  # a strided view, as the batcher reads from a volume
    for rot in ROTATIONS:
        view = np.flip(
            np.transpose(window, (0, *(1 + p for p in rot.perm))), [1 + a for a in range(3) if rot.signs[a] < 0]
        )
        expected = (
            view[[0, *(1 + p for p in rot.perm), 4]] * np.array([1, *rot.signs, 1], np.float32)[:, None, None, None]
        )
        assert np.array_equal(rotate_volume(window, rot, [[1, 2, 3]]), expected), rot
