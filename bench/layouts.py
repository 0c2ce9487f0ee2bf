"""How fast each file layout gives up crops, per reading thread, from a warm page cache and a cold one: what lazy
storage costs on each. ``python -m bench.pipeline --layouts`` runs it; its table is in docs/data.md (At full scale).

Each layout holds the same box: the reference's contiguous HDF5, HDF5 in chunks, .npy CDHW and DHWC, and bricks.
A crop is read as the trainer reads it lazily (``VolumePair.read_crop``), all channels; cold, the files' pages are
dropped before each crop and the pages it brought in are counted (``mincore``).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from bench.env import REPO, append_records, environment, update_doc
from pipeline.convert import convert
from pipeline.layout import HYDRO_DATASET, NBODY_DATASET
from pipeline.volumes import VolumeFiles, VolumePair

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_PAGE = os.sysconf("SC_PAGE_SIZE")


def drop_cached(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages: the files are only read here)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(paths: list[Path]) -> int:
    """Bytes of the files that are in the page cache now."""
    total = 0
    for path in paths:
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        address = _LIBC.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        os.close(fd)
        pages = (size + _PAGE - 1) // _PAGE
        vector = (ctypes.c_ubyte * pages)()
        failed = _LIBC.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector)
        _LIBC.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
        if failed:
            raise OSError(ctypes.get_errno(), "mincore")
        total += int((np.frombuffer(vector, np.uint8) & 1).sum()) * _PAGE
    return total


def make_layouts(box: Path) -> dict[str, VolumeFiles]:
    """The box in every layout (written beside it once): name -> files."""
    stem = box.with_suffix("")
    chunked = Path(f"{stem}_chunked.h5")
    if not chunked.exists():
        with h5py.File(box, "r", locking=False) as src, h5py.File(chunked, "w") as dst:
            for name in (NBODY_DATASET, HYDRO_DATASET):
                data = dst.create_dataset(name, shape=src[name].shape, dtype=np.float32, chunks=(1, 32, 32, 32))
                for c in range(src[name].shape[0]):
                    data[c] = src[name][c]
    layouts = {"hdf5 contiguous": VolumeFiles.hdf5(box), "hdf5 chunks 32^3": VolumeFiles.hdf5(chunked)}
    for layout in ("CDHW", "DHWC", "bricks"):
        prefix = Path(f"{stem}_{layout.lower()}")
        pair = (Path(f"{prefix}_data.npy"), Path(f"{prefix}_label.npy"))
        if not (pair[0].exists() and pair[1].exists()):
            convert(box, prefix, layout)
        layouts[f"npy {layout}" if layout != "bricks" else "npy bricks 32^3"] = VolumeFiles.npy(*pair, layout)
    return layouts


def time_layout(files: VolumeFiles, *, crop: int, crops: int, cold: bool, seed: int = 0) -> dict[str, Any]:
    """One thread reading ``crops`` random crops: crops/s and, cold, MiB brought into the page cache per crop (the
    files opened afresh for each, as pages a process maps are not dropped)."""
    paths = sorted({Path(files.inputs), Path(files.targets)})
    volumes = VolumePair.open(files, 4, 5, crop_size=crop)
    corners = np.random.default_rng(seed).integers(0, volumes.box_size - crop + 1, size=(crops, 3))
    inputs, targets = np.empty((4, crop, crop, crop), np.float32), np.empty((5, crop, crop, crop), np.float32)
    if not cold:
        for corner in corners:  # the cache warmed by the same crops
            volumes.read_crop(tuple(int(c) for c in corner), crop, inputs, targets=targets)
    seconds, brought = [], []
    for corner in corners:
        if cold:
            del volumes
            drop_cached(paths)
            volumes = VolumePair.open(files, 4, 5, crop_size=crop)
        start = time.perf_counter()
        volumes.read_crop(tuple(int(c) for c in corner), crop, inputs, targets=targets)
        seconds.append(time.perf_counter() - start)
        if cold:
            brought.append(cached_bytes(paths))
    rate = 1 / statistics.median(seconds)
    return {"crops_per_s": rate, "read_mib_per_crop": statistics.median(brought) / 2**20 if cold else None}


def table(records: list[dict[str, Any]]) -> str:
    """A markdown table of one run: per layout, warm and cold crops/s per thread, and cold MiB read per crop."""
    first = records[0]
    head = (
        f"{first['box']}^3 box, {first['crop']}^3 crops of 9 channels, one thread, {first['crops']} crops per case; "
        f"{first['cpu']}, measured {first['time']}"
    )
    rows = ["| layout | warm crops/s | cold crops/s | cold MiB read per crop |", "| --- | ---: | ---: | ---: |"]
    for r in records:
        rows.append(
            f"| {r['layout']} | {r['warm_crops_per_s']:.0f} | {r['cold_crops_per_s']:.0f} | {r['read_mib']:.1f} |"
        )
    return "\n".join([head, "", *rows])


def main(args: Any, *, crop: int, out: Path) -> None:
    """bench.pipeline --layouts: every layout of ``args.data``, warm and cold; records appended to ``out``, the
    table printed (and put in docs/data.md when ``out`` is the project's results file)."""
    from pipeline.synthetic import SyntheticSpec, write_box

    if not args.data.exists():
        write_box(args.data, SyntheticSpec(train_box_size=args.box), args.box, seed=0)
    env, records = environment(), []
    crops = args.batches * args.batch // 4
    for name, files in make_layouts(args.data).items():
        warm = time_layout(files, crop=crop, crops=crops, cold=False)
        cold = time_layout(files, crop=crop, crops=crops, cold=True)
        box = VolumePair.open(files, 4, 5, crop_size=crop).box_size
        record = {"bench": "layouts", "layout": name, "box": box, "crop": crop, "crops": crops}
        record |= {"warm_crops_per_s": warm["crops_per_s"], "cold_crops_per_s": cold["crops_per_s"]}
        record |= {"read_mib": cold["read_mib_per_crop"], **env}
        records.append(record)
        print(
            f"{name}: {record['warm_crops_per_s']:.0f} crops/s warm, {record['cold_crops_per_s']:.0f} cold", flush=True
        )
    append_records(out, records)
    text = table(records)
    print(text)
    if out == REPO / "bench" / "results" / "layouts.jsonl":
        update_doc(REPO / "docs" / "data.md", text, name="layouts")
