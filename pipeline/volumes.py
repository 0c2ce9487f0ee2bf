"""Opening the (input, target) volumes of a split, with the checks that catch bad data before training.

Two formats: the reference's HDF5 files (datasets ``Nbody`` and ``Hydro`` in one file) and ``.npy``
files, one for inputs and one for targets, memory-mapped, channels first (CDHW) or last (DHWC) as
declared. Whatever the format, ``VolumePair`` exposes both volumes as (C, L, L, L) array-likes, so
that cutting a crop is the same slicing for all of them.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np

from pipeline.bricks import Bricks
from pipeline.layout import HYDRO_DATASET, NBODY_DATASET
from pipeline.rotations import Rotation, VectorGroups, rotate_into

DataFormat = Literal["hdf5", "npy"]
NpyLayout = Literal["CDHW", "DHWC", "bricks"]


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file and the problem."""


@dataclass(frozen=True, kw_only=True)
class VolumeFiles:
    """Where one split's volumes are: an HDF5 file, or a pair of .npy files."""

    format: DataFormat
    inputs: Path
    targets: Path
    npy_layout: NpyLayout = "CDHW"

    @classmethod
    def hdf5(cls, path: str | Path) -> VolumeFiles:
        return cls(format="hdf5", inputs=Path(path), targets=Path(path))

    @property
    def reader(self) -> str:
        """How crops come out of the files: 'hdf5', 'npy' (an array per file), or 'bricks'."""
        return "hdf5" if self.format == "hdf5" else "bricks" if self.npy_layout == "bricks" else "npy"

    @classmethod
    def npy(cls, inputs: str | Path, targets: str | Path, layout: NpyLayout) -> VolumeFiles:
        return cls(format="npy", inputs=Path(inputs), targets=Path(targets), npy_layout=layout)


def _require_file(path: Path) -> None:
    if path.is_dir():
        raise DataError(f"{path}: a directory, not a data file")
    if not path.is_file():
        raise DataError(f"{path}: no such data file")


def read_hdf5(path: str | Path) -> h5py.File:
    """An HDF5 file opened to read, without HDF5's file locking: a reader needs none, and a file system that refuses
    locks (ENOLCK on some NFS mounts), or a lock another process holds, would otherwise stop it."""
    return h5py.File(path, "r", locking=False)


def open_hdf5(path: Path, name: str) -> h5py.Dataset:
    """A dataset of an HDF5 file, opened read-only (``dataset.file`` closes it); DataError if it is not there."""
    _require_file(path)
    try:
        f = read_hdf5(path)
    except OSError as err:
        raise DataError(f"{path}: not a readable HDF5 file ({err})") from None
    if name not in f:
        raise DataError(f"{path}: no dataset '{name}' (found: {sorted(f.keys())})")
    return f[name]


def open_npy(path: Path, layout: NpyLayout) -> Any:
    """A .npy file memory-mapped, read as (C, L, L, L): a view of a DHWC array, a ``Bricks`` of a bricked one."""
    _require_file(path)
    try:
        array = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as err:
        raise DataError(f"{path}: not a readable .npy file ({err})") from None
    if not isinstance(array, np.ndarray):
        raise DataError(f"{path}: not a single array")
    if layout == "DHWC" and array.ndim == 4:
        return array.transpose(3, 0, 1, 2)  # a strided CDHW view: no copy
    if layout == "bricks":
        if array.ndim != 7 or len({*array.shape[:3]}) != 1 or len({*array.shape[4:]}) != 1:
            raise DataError(
                f"{path}: an array of shape {tuple(array.shape)}, not bricks (n, n, n, channels, b, b, b) as "
                "npy_layout bricks declares (python -m pipeline.convert --layout bricks writes them)"
            )
        mapped = getattr(array, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_RANDOM"):
            mapped.madvise(mmap.MADV_RANDOM)  # a crop reads its bricks' pages, not the readahead's beyond them
        return Bricks(array)
    return array


def target_attributes(files: VolumeFiles) -> dict[str, Any]:
    """The attributes of the targets' HDF5 file, the normalization it declares included, read and closed again
    (.npy files carry none)."""
    if files.format != "hdf5":
        return {}
    target = open_hdf5(files.targets, HYDRO_DATASET)
    with target.file as f:
        return dict(f.attrs)


def _check(array: Any, path: Path, what: str, *, channels: int | None, layout: str | None) -> None:
    """``layout``: the npy_layout the config declared (None for HDF5, always channels first); ``channels``: the
    number expected, or None for any."""
    if array.ndim != 4 or len(set(array.shape[1:])) != 1:
        shape = tuple(array.shape) if layout != "DHWC" else tuple(array.shape[1:]) + (array.shape[0],)
        expected = "(L, L, L, channels)" if layout == "DHWC" else "(channels, L, L, L)"
        declared = f" as npy_layout {layout} declares" if layout else ""
        raise DataError(f"{path}: {what} has shape {shape}, expected {expected}{declared}")
    if channels is not None and array.shape[0] != channels:
        raise DataError(f"{path}: {what} has {array.shape[0]} channels, the model expects {channels}")
    if not np.issubdtype(array.dtype, np.floating):
        raise DataError(f"{path}: {what} holds {array.dtype}, expected floating point")


@dataclass
class VolumePair:
    """Input and target volumes of one split, each a (C, L, L, L) array-like.

    ``open`` keeps them on disk (h5py datasets or memory maps: each crop is a read); ``load`` reads
    them into memory once, as contiguous float32 arrays.
    """

    files: VolumeFiles
    nbody: Any
    hydro: Any

    @property
    def box_size(self) -> int:
        return int(self.nbody.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of both volumes as float32."""
        return 4 * (int(np.prod(self.nbody.shape)) + int(np.prod(self.hydro.shape)))

    @classmethod
    def open(
        cls, files: VolumeFiles, in_channels: int | None, out_channels: int | None, *, crop_size: int
    ) -> VolumePair:
        if files.format == "hdf5":
            nbody, hydro = open_hdf5(files.inputs, NBODY_DATASET), open_hdf5(files.targets, HYDRO_DATASET)
            names = (f"dataset '{NBODY_DATASET}'", f"dataset '{HYDRO_DATASET}'")
            layout = None
        else:
            nbody, hydro = open_npy(files.inputs, files.npy_layout), open_npy(files.targets, files.npy_layout)
            names = ("the input array", "the target array")
            layout = files.npy_layout
        _check(nbody, files.inputs, names[0], channels=in_channels, layout=layout)
        _check(hydro, files.targets, names[1], channels=out_channels, layout=layout)
        if nbody.shape[1:] != hydro.shape[1:]:
            raise DataError(
                f"{files.inputs}: inputs {tuple(nbody.shape)} and targets {tuple(hydro.shape)} cover different boxes"
            )
        if crop_size > nbody.shape[1]:
            raise DataError(f"{files.inputs}: crop size {crop_size} is larger than the box ({nbody.shape[1]}^3)")
        return cls(files=files, nbody=nbody, hydro=hydro)

    def check_finite(self, crop_size: int, samples: int = 8, seed: int = 0) -> None:
        """DataError if the volumes hold NaN or Inf: all of them up to 1 GiB, else ``samples`` random crops."""
        if self.nbytes <= 2**30:
            windows = [np.s_[...]]
        else:
            rng = np.random.default_rng(seed)
            corners = rng.integers(0, self.box_size - crop_size + 1, size=(samples, 3))
            windows = [_window(tuple(int(c) for c in corner), crop_size) for corner in corners]
        for volume, path, name in (
            (self.nbody, self.files.inputs, "inputs"),
            (self.hydro, self.files.targets, "targets"),
        ):
            for window in windows:
                if not np.isfinite(volume[window]).all():
                    where = (
                        ""
                        if window == np.s_[...]
                        else f" (in the {crop_size}^3 crop at {window[1].start, window[2].start, window[3].start})"
                    )
                    raise DataError(f"{path}: the {name} hold NaN or Inf values{where}")

    def load(self) -> VolumePair:
        """The same volumes read into memory as contiguous float32 CDHW arrays."""
        return VolumePair(self.files, _to_memory(self.nbody), _to_memory(self.hydro))

    def read_crop(self, corner: tuple[int, int, int], size: int, inputs: np.ndarray, *, targets: np.ndarray) -> None:
        """Copy the crop of ``size``^3 at ``corner`` into ``inputs`` and ``targets`` as it is."""
        window = _window(corner, size)
        for volume, out in ((self.nbody, inputs), (self.hydro, targets)):
            if isinstance(volume, h5py.Dataset) and volume.dtype == np.float32:
                volume.read_direct(out, window)
            else:
                np.copyto(out, volume[window])

    def cut(
        self,
        corner: tuple[int, int, int],
        size: int,
        rot: Rotation,
        *,
        groups: tuple[VectorGroups, VectorGroups],
        inputs: np.ndarray,
        targets: np.ndarray,
    ) -> None:
        """Cut the crop at ``corner`` rotated by ``rot`` into ``inputs`` and ``targets``: one copy from memory."""
        window = _window(corner, size)
        for volume, vectors, out in ((self.nbody, groups[0], inputs), (self.hydro, groups[1], targets)):
            crop = volume[window]  # a view of an in-memory array; a read for h5py datasets
            rotate_into(crop, rot, vectors, out=out)


def _window(corner: tuple[int, int, int], size: int) -> tuple[slice, ...]:
    x, y, z = corner
    return np.s_[:, x : x + size, y : y + size, z : z + size]


def _to_memory(volume: Any) -> np.ndarray:
    if isinstance(volume, h5py.Dataset):
        return volume[...].astype(np.float32, copy=False)
    return np.ascontiguousarray(volume, dtype=np.float32)
