"""Opening a pair of N-body / hydro volumes, with the checks that catch bad data before training."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import h5py
import numpy as np

from pipeline.layout import HYDRO_DATASET, NBODY_DATASET

Storage = Literal["host", "lazy"]


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file and the problem."""


@dataclass
class VolumePair:
    """The input (``Nbody``) and target (``Hydro``) volumes of one file, each (C, L, L, L).

    With ``storage="host"`` both are numpy arrays read once (the reference's 'inmem'); with
    ``"lazy"`` they are h5py datasets and every crop is a read from the file ('lowmem'). Both
    slice the same way, so the code that cuts crops does not care which it has.
    """

    path: Path
    nbody: np.ndarray | h5py.Dataset
    hydro: np.ndarray | h5py.Dataset
    storage: Storage

    @property
    def box_size(self) -> int:
        return int(self.nbody.shape[1])

    @classmethod
    def open(cls, path: str | Path, in_channels: int, out_channels: int, crop_size: int, storage: Storage) -> VolumePair:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such data file")
        try:
            f = h5py.File(path, "r")
        except OSError as err:
            raise DataError(f"{path}: not a readable HDF5 file ({err})") from None
        datasets = {}
        for name, channels in ((NBODY_DATASET, in_channels), (HYDRO_DATASET, out_channels)):
            if name not in f:
                raise DataError(f"{path}: no dataset '{name}' (found: {sorted(f.keys())})")
            ds = f[name]
            if ds.ndim != 4 or len(set(ds.shape[1:])) != 1:
                raise DataError(f"{path}: dataset '{name}' has shape {ds.shape}, expected (channels, L, L, L)")
            if ds.shape[0] != channels:
                raise DataError(f"{path}: dataset '{name}' has {ds.shape[0]} channels, the model expects {channels}")
            if not np.issubdtype(ds.dtype, np.floating):
                raise DataError(f"{path}: dataset '{name}' holds {ds.dtype}, expected floating point")
            datasets[name] = ds
        if datasets[NBODY_DATASET].shape[1:] != datasets[HYDRO_DATASET].shape[1:]:
            raise DataError(
                f"{path}: '{NBODY_DATASET}' {datasets[NBODY_DATASET].shape} and "
                f"'{HYDRO_DATASET}' {datasets[HYDRO_DATASET].shape} cover different boxes"
            )
        box = datasets[NBODY_DATASET].shape[1]
        if crop_size > box:
            raise DataError(f"{path}: crop size {crop_size} is larger than the box ({box}^3)")
        if storage == "host":
            arrays = {name: ds[...].astype(np.float32, copy=False) for name, ds in datasets.items()}
            f.close()
            return cls(path, arrays[NBODY_DATASET], arrays[HYDRO_DATASET], storage)
        return cls(path, datasets[NBODY_DATASET], datasets[HYDRO_DATASET], storage)

    def crop(self, corner: tuple[int, int, int], size: int) -> tuple[np.ndarray, np.ndarray]:
        """The (input, target) crop of ``size``^3 voxels at ``corner``, as contiguous float32 arrays."""
        x, y, z = corner
        window = np.s_[:, x : x + size, y : y + size, z : z + size]
        return (
            np.ascontiguousarray(self.nbody[window], dtype=np.float32),
            np.ascontiguousarray(self.hydro[window], dtype=np.float32),
        )
