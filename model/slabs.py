"""The slab files of a prediction: the blocks each holds, the ranks' shares, which are done, the virtual dataset over
them, and what a killed run or another prediction left in the output directory.

A slab file is written under a hidden name and renamed when whole, with the prediction's resume key (``params``:
input, emulator, tiling and blend, settings) in its attributes: a run continues from the slabs of the same key, and
the slabs of any other are reclaimed before it starts, never assembled into it. docs/prediction.md tells the story.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.files import PARTIAL, reclaim, temporaries, written_atomically
from model.tiling import Tiling
from pipeline.layout import HYDRO_CHANNELS, HYDRO_DATASET
from pipeline.volumes import DataError, read_hdf5

PREDICTION = "prediction.h5"
SLABS = "prediction.slabs"
METRICS = "metrics.json"
FIGURES = ("slices.png", "spectra.png", "phases.png")
OUTPUTS = (PREDICTION, SLABS, METRICS, *FIGURES)  # every name model.predict writes in its output directory
CHUNK = 64  # chunks of 64^3 voxels of a channel


@dataclass(frozen=True, kw_only=True)
class SlabPlan:
    """The slab files of one prediction: runs of ``per_slab`` consecutive blocks of ``tiling``, keyed by ``params``."""

    tiling: Tiling
    per_slab: int
    params: str

    @cached_property
    def slabs(self) -> list[list[int]]:
        blocks = list(range(len(self.tiling.blocks)))
        return [blocks[i : i + self.per_slab] for i in range(0, len(blocks), self.per_slab)]

    def planes(self, index: int) -> tuple[int, int]:
        blocks = self.slabs[index]
        return self.tiling.blocks[blocks[0]][0], self.tiling.blocks[blocks[-1]][1]

    def share(self, *, rank: int, ranks: int) -> list[int]:
        """A rank's slabs: a run of them whose blocks are as near its share of all blocks as whole slabs allow."""
        total = sum(len(s) for s in self.slabs)
        starts = np.cumsum([0] + [len(s) for s in self.slabs[:-1]])
        return [i for i, start in enumerate(starts) if rank * total // ranks <= start < (rank + 1) * total // ranks]

    def finished(self, out_dir: Path, index: int) -> bool:
        """Whether slab ``index`` is there, whole, from this very prediction."""
        return _params_of(slab_path(out_dir, index)) == (self.params, self.planes(index))

    def stale(self, out_dir: Path) -> tuple[list[Path], list[Path]]:
        """What killed runs left (hidden partial slabs and outputs), and the files of another prediction: its slabs
        and the prediction file, metrics and figures that go with them."""
        slab_dir = out_dir / SLABS
        killed = temporaries(out_dir, OUTPUTS)
        if slab_dir.is_dir():
            killed += sorted(slab_dir.glob(f".slab-*.h5*{PARTIAL}"))
        mine = {slab_path(out_dir, i): (self.params, self.planes(i)) for i in range(len(self.slabs))}
        others = [p for p in sorted(slab_dir.glob("slab-*.h5")) if _params_of(p) != mine.get(p, ())]
        earlier = out_dir / PREDICTION
        if earlier.exists() and (others or _prediction_params(earlier) != self.params):
            others += [earlier, *(out_dir / name for name in (METRICS, *FIGURES) if (out_dir / name).exists())]
        return killed, others


def slab_path(out_dir: Path, index: int) -> Path:
    return out_dir / SLABS / f"slab-{index:04d}.h5"


def _params_of(path: Path) -> tuple[str, tuple[int, int]] | None:
    try:
        with read_hdf5(path) as f:
            return str(f.attrs["params"]), tuple(int(v) for v in f.attrs["planes"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _prediction_params(path: Path) -> str | None:
    try:
        with read_hdf5(path) as f:
            return json.loads(f.attrs["prediction"]).get("params")
    except (OSError, KeyError, ValueError, TypeError, AttributeError):
        return None


def reclaim_stale(out_dir: Path, plan: SlabPlan) -> list[str]:
    """Remove what killed runs and other predictions left (``SlabPlan.stale``); a line for each kind found."""
    killed, others = plan.stale(out_dir)
    lines = [reclaim(killed, what="what killed runs left"), reclaim(others, what="another prediction's files")]
    return [line for line in lines if line]


def earlier_prediction(entry: Path) -> bool:
    """Whether an entry of an output directory from before marks existed is model.predict's: a prediction file, its
    slab directory, and the metrics and figures beside a prediction file of its own."""
    if entry.name == SLABS:
        return entry.is_dir() and all(p.name.startswith(("slab-", ".slab-")) for p in entry.iterdir())
    if entry.name in (METRICS, *FIGURES):
        return earlier_prediction(entry.parent / PREDICTION)
    if entry.name != PREDICTION:
        return False
    try:
        with read_hdf5(entry) as f:
            return "prediction" in f.attrs
    except OSError:
        return False


class SlabFiles:
    """The slab files a run of blocks goes into: each written under a hidden name as its blocks come, and given its
    final name once whole (a killed run leaves only whole slab files, and hidden ones that the next run reclaims)."""

    def __init__(self, out_dir: Path, plan: SlabPlan, indices: list[int], **h5: Any) -> None:
        self.out_dir, self.plan, self.h5 = out_dir, plan, h5
        self.open: dict[int, tuple[h5py.File, Path, set[int]]] = {}
        self.slab_of = {block: index for index in indices for block in plan.slabs[index]}

    def write(self, block: int, values: np.ndarray) -> None:
        index = self.slab_of[block]
        if index not in self.open:
            self._start(index)
        f, _, left = self.open[index]
        lo = self.plan.planes(index)[0]
        a, b = self.plan.tiling.blocks[block]
        f[HYDRO_DATASET][:, a - lo : b - lo] = values
        left.discard(block)
        if not left:
            self._finish(index)

    def _start(self, index: int) -> None:
        (lo, hi), (_, ny, nz) = self.plan.planes(index), self.plan.tiling.shape
        final = slab_path(self.out_dir, index)
        final.parent.mkdir(exist_ok=True)
        partial = final.with_name(f".{final.name}{PARTIAL}")
        f = h5py.File(partial, "w")
        channels = self.h5["channels"]
        chunks = (1, min(CHUNK, hi - lo), min(CHUNK, ny), min(CHUNK, nz))
        options = {k: v for k, v in self.h5.items() if k != "channels"}
        f.create_dataset(HYDRO_DATASET, shape=(channels, hi - lo, ny, nz), dtype=np.float32, chunks=chunks, **options)
        f.attrs["planes"], f.attrs["params"] = (lo, hi), self.plan.params
        self.open[index] = (f, partial, set(self.plan.slabs[index]))

    def _finish(self, index: int) -> None:
        f, partial, _ = self.open.pop(index)
        f.close()
        os.replace(partial, slab_path(self.out_dir, index))

    def close(self) -> None:
        """Where a run stopped part way: its unfinished slab files go."""
        for f, partial, _ in self.open.values():
            f.close()
            partial.unlink(missing_ok=True)
        self.open.clear()


def assemble(out_dir: Path, plan: SlabPlan, *, attrs: dict, channels: int, info: dict) -> Path:
    """``prediction.h5``: one ``Hydro`` dataset over this plan's slab files (a virtual dataset: nothing copied), with
    the input's attributes and ``info``; written under its final name only once whole."""
    shape = (channels, *plan.tiling.shape)
    layout = h5py.VirtualLayout(shape=shape, dtype=np.float32)
    for index in range(len(plan.slabs)):
        path = slab_path(out_dir, index)
        if not plan.finished(out_dir, index):
            raise DataError(f"{path}: missing, or not of this prediction: run the same command again to predict it")
        lo, hi = plan.planes(index)
        relative = os.path.relpath(path, out_dir)  # the directory moved, the file stays readable
        layout[:, lo:hi] = h5py.VirtualSource(relative, HYDRO_DATASET, shape=(channels, hi - lo, *shape[2:]))
    out = out_dir / PREDICTION
    with written_atomically(out) as partial, h5py.File(partial, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs["prediction"] = json.dumps({**info, "params": plan.params})
        hydro = f.create_virtual_dataset(HYDRO_DATASET, layout, fillvalue=np.nan)
        hydro.attrs["channels"] = json.dumps(HYDRO_CHANNELS)
    return out
