"""The memory and reads a node's ranks spend on the data, measured: a rehearsal of the reference's box, scaled down.

    python -m bench.memory                            # 512^3 box, 4 CPU ranks, host storage, against a 128^3 box
    python -m bench.memory --storage lazy --data_format npy   # the same box converted to bricks, read lazily

Each case is a short training run through the deepspeed launcher while this process samples the machine's
MemAvailable (shared memory and process memory count, reclaimable page cache does not) and the bytes each rank reads;
the data's share is the big box's run less the small box's. One record per case in bench/results/memory.jsonl.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import psutil

from bench.cases import launch
from bench.env import REPO, append_records, environment
from common.cli import ArgumentParser, output_file
from pipeline.convert import convert
from pipeline.layout import HYDRO_DATASET, NBODY_DATASET
from pipeline.storage import HOST, STORAGES

RESULTS = REPO / "bench" / "results" / "memory.jsonl"
DATA = REPO / "data" / "bench"


def random_box(path: Path, box: int) -> Path:
    """An HDF5 box of ``box``^3 with the reference's datasets (contiguous float32), uniform noise in [-1, 1]: what
    is measured here is memory and reads, not learning. Written slab by slab; kept for the next run."""
    if path.exists():
        return path
    tmp = path.with_suffix(".partial")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with h5py.File(tmp, "w") as f:
        for name, channels in ((NBODY_DATASET, 4), (HYDRO_DATASET, 5)):
            dataset = f.create_dataset(name, shape=(channels, box, box, box), dtype=np.float32)
            for c in range(channels):
                for x in range(0, box, 64):
                    dataset[c, x : x + 64] = rng.uniform(-1, 1, (min(64, box - x), box, box)).astype(np.float32)
    tmp.rename(path)
    return path


def _available() -> int:
    return psutil.virtual_memory().available


def _read_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])
    except (OSError, StopIteration):
        return None


def measure(command: list[str]) -> dict[str, Any]:
    """Run ``command``; the peak drop of MemAvailable under it and the bytes each of the launcher's ranks read."""
    baseline = _available()
    lowest, reads = [baseline], {}

    def sample(pid: int) -> None:
        lowest[0] = min(lowest[0], _available())
        try:
            for child in psutil.Process(pid).children(recursive=True):
                read = _read_bytes(child.pid)
                if read is not None and "--local_rank" in " ".join(child.cmdline()):  # a rank, not the launcher
                    reads[child.pid] = max(reads.get(child.pid, 0), read)
        except psutil.Error:  # a process gone meanwhile
            pass

    launched = launch(command, watch=sample)
    if launched.returncode != 0:
        sys.exit(f"the run failed (exit status {launched.returncode}):\n{launched.output[-3000:]}")
    return {
        "peak_drop_gib": (baseline - lowest[0]) / 2**30,
        "rank_reads_gib": sorted(r / 2**30 for r in reads.values()),
    }


def _npy_pair(path: Path, layout: str) -> tuple[Path, Path]:
    """The box as a .npy pair in ``layout`` beside it (converted once)."""
    prefix = Path(f"{path.with_suffix('')}_{layout.lower()}")
    pair = (Path(f"{prefix}_data.npy"), Path(f"{prefix}_label.npy"))
    return pair if pair[0].exists() and pair[1].exists() else convert(path, prefix, layout)


def case(args: Any, box: int, run_dir: Path) -> dict[str, Any]:
    train = random_box(DATA / f"random_{box}.h5", box)
    val = random_box(DATA / "random_64.h5", 64)
    data = ["--train_path", str(train), "--val_path", str(val)]
    if args.data_format == "npy":
        (train_data, train_label), (val_data, val_label) = (_npy_pair(path, args.npy_layout) for path in (train, val))
        data = ["--data_format", "npy", "--npy_layout", args.npy_layout]
        data += ["--train_path_npy_data", str(train_data), "--train_path_npy_label", str(train_label)]
        data += ["--val_path_npy_data", str(val_data), "--val_path_npy_label", str(val_label)]
    options = ["--config", "debug", "--synthetic", "null", *data, "--storage", args.storage, "--num_epochs", "1"]
    options += ["--Nsamples", str(16 * args.ranks), "--Nsamples_val", str(4 * args.ranks), "--run_dir", str(run_dir)]
    options += ["--overwrite", "--num_data_workers", "1", "--cpu_threads", "1"]
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.ranks)]
    return {"box": box, "volume_gib": 9 * 4 * box**3 / 2**30, **measure([*launcher, "ds_train.py", *options])}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--box", type=int, default=512, help="side of the training box")
    parser.add_argument("--small", type=int, default=128, help="side of the box whose run is the baseline")
    parser.add_argument("--ranks", type=int, default=4, help="ranks on this node (the deepspeed launcher)")
    parser.add_argument(
        "--storage", choices=[n for n, mode in STORAGES.items() if not mode.on_device], default=HOST.name
    )
    parser.add_argument("--data_format", choices=["hdf5", "npy"], default="hdf5")
    parser.add_argument("--npy_layout", choices=["bricks", "CDHW"], default="bricks", help="with --data_format npy")
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    args = parser.parse_args(argv)
    runs = REPO / "runs" / "bench-memory"
    small, big = (case(args, box, runs / f"{box}") for box in (args.small, args.box))
    added = big["peak_drop_gib"] - small["peak_drop_gib"]
    copy = big["volume_gib"] - small["volume_gib"]
    record = {
        "bench": "memory",
        "storage": args.storage,
        "data_format": args.data_format if args.data_format == "hdf5" else f"npy {args.npy_layout}",
        "ranks": args.ranks,
        "box": args.box,
        "small_box": args.small,
        "copy_gib": copy,
        "data_added_gib": added,
        "copies": added / copy,
        "runs": [small, big],
        **environment(),
    }
    append_records(args.out, [record])
    print(json.dumps({k: v for k, v in record.items() if k not in environment()}, indent=1))


if __name__ == "__main__":
    main()
