"""Throughput of the input pipeline alone, per backend x storage mode x crop size, against the reference's way of
loading and against a plain copy of the same crops (the memory bandwidth), on the same file and cores.

    python -m bench.pipeline                       # CPU or GPU, whatever is here
    python -m bench.pipeline --report              # regenerate the table in docs/benchmarks.md from the results

docs/benchmarks.md (The input pipeline) tells what each case does and how it is timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bench.cases import rate_summary, rounds
from bench.env import DOC, REPO, append_records, environment, read_records, update_doc
from bench.layouts import drop_cached
from common.cli import ArgumentParser, existing_file, output_file
from pipeline.backends import BACKENDS, TORCH
from pipeline.convert import convert
from pipeline.layout import HYDRO_DATASET, NBODY_DATASET
from pipeline.loaders import LoaderSettings, build_loader
from pipeline.rotations import ROTATIONS, channel_order, channel_signs
from pipeline.sampling import Augmenter, DrawPlan
from pipeline.storage import LAZY, STORAGES
from pipeline.synthetic import SyntheticSpec, write_box
from pipeline.volumes import VolumeFiles, VolumePair, read_hdf5

RESULTS = REPO / "bench" / "results" / "pipeline.jsonl"
LAYOUTS = REPO / "bench" / "results" / "layouts.jsonl"
AUG = Augmenter(in_channels=4, out_channels=5, in_vectors=[[1, 2, 3]], out_vectors=[[1, 2, 3]])


class ReferenceStyleCrops(Dataset):
    """One rotated crop per item, read with h5py in the worker, as the tutorial's lowmem loader does."""

    def __init__(self, path: Path, plan: DrawPlan) -> None:
        self.path, self.plan = path, plan
        self.file = None

    def __len__(self) -> int:
        return self.plan.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.file is None:
            self.file = read_hdf5(self.path)
        draw = self.plan.batch_draws(0, index // self.plan.batch_size)[index % self.plan.batch_size]
        size, (x, y, z) = self.plan.crop_size, draw.corner
        rot = ROTATIONS[draw.rotation]
        out = []
        for name, channels in ((NBODY_DATASET, AUG.in_channels), (HYDRO_DATASET, AUG.out_channels)):
            crop = np.empty((channels, size, size, size), dtype=np.float32)
            self.file[name].read_direct(crop, np.s_[:, x : x + size, y : y + size, z : z + size])
            view = np.flip(crop.transpose(0, *(1 + p for p in rot.perm)), [1 + a for a in range(3) if rot.signs[a] < 0])
            rotated = np.copy(view)
            # The velocity fix touches only the three vector channels: permute them, negate where flipped.
            rotated[1:4] = rotated[list(channel_order(rot.perm, channels, [[1, 2, 3]])[1:4])]
            for c, sign in enumerate(channel_signs(rot, channels, [[1, 2, 3]])):
                if sign < 0:
                    np.negative(rotated[c], out=rotated[c])
            out.append(torch.as_tensor(rotated))
        return out[0], out[1]


class PlainCopies:
    """The limit: the same crops copied out of the volumes in memory, not rotated, on the same number of threads,
    into one reused buffer (then moved to the GPU, if any). No pipeline that cuts these crops can beat the memory
    bandwidth this measures; each case's fraction of it is how close to the machine it runs."""

    def __init__(self, volumes: VolumePair, plan: DrawPlan, threads: int, *, device: torch.device) -> None:
        self.nbody, self.hydro = volumes.nbody, volumes.hydro  # already in memory
        self.plan, self.device = plan, device
        self.pool = ThreadPoolExecutor(max_workers=threads)
        size = plan.crop_size
        self.inputs = np.empty((plan.batch_size, self.nbody.shape[0], size, size, size), np.float32)
        self.targets = np.empty((plan.batch_size, self.hydro.shape[0], size, size, size), np.float32)

    def _copy(self, j: int, corner: tuple[int, int, int]) -> None:
        (x, y, z), s = corner, self.plan.crop_size
        np.copyto(self.inputs[j], self.nbody[:, x : x + s, y : y + s, z : z + s])
        np.copyto(self.targets[j], self.hydro[:, x : x + s, y : y + s, z : z + s])

    def __iter__(self) -> Any:
        for batch in range(self.plan.num_batches):
            draws = self.plan.batch_draws(0, batch)
            for future in [self.pool.submit(self._copy, j, d.corner) for j, d in enumerate(draws)]:
                future.result()
            n = len(draws)
            yield torch.from_numpy(self.inputs[:n]).to(self.device), torch.from_numpy(self.targets[:n]).to(self.device)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _time_batches(batches: Any, warmup: int, measured: int, *, device: torch.device, batch: int) -> dict[str, float]:
    """Discard ``warmup`` batches, then time ``measured`` ones (synchronizing the device at both ends only)."""
    iterator = iter(batches)
    for _ in range(warmup):
        inputs, targets = next(iterator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    for _ in range(measured):
        t = time.perf_counter()
        inputs, targets = next(iterator)
        if device.type != "cuda":
            times.append(time.perf_counter() - t)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    record = {"samples_per_s": measured * batch / elapsed, "wall_s": elapsed}
    if times:  # per-batch host times are only meaningful where the work is synchronous
        record["batch_ms_p50"] = 1000 * statistics.median(times)
        record["batch_ms_p90"] = 1000 * float(np.percentile(times, 90))
    return record


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time every case; a case's record (the median of its repeats so far) is appended to ``args.out`` each time it
    is timed, so that a run stopped early (a time limit) keeps what it finished; the table takes each case's last."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    path = args.data
    if not path.exists():
        print(f"writing a {args.box}^3 synthetic box to {path} ...", flush=True)
        write_box(path, SyntheticSpec(train_box_size=args.box), args.box, seed=0)
    backends = [TORCH] if args.no_dali else list(BACKENDS)
    storages = [name for name, mode in STORAGES.items() if device.type == "cuda" or not mode.on_device]
    storages.insert(storages.index(LAZY.name) + 1, f"{LAZY.name}-npy")  # lazy reads of .npy files too
    npy = path.with_suffix("")  # the same box as .npy files, for DALI's numpy reader and lazy memory maps
    if not Path(f"{npy}_data.npy").exists() and (not args.cases or any(c.endswith("-npy") for c in args.cases)):
        convert(path, npy, "CDHW")
    env = environment()
    records = []
    for crop in args.crops:
        volumes = VolumePair.open(VolumeFiles.hdf5(path), 4, 5, crop_size=crop)
        npy_files = VolumeFiles.npy(f"{npy}_data.npy", f"{npy}_label.npy", "CDHW")
        npy_volumes = VolumePair.open(npy_files, 4, 5, crop_size=crop) if Path(npy_files.inputs).exists() else None
        total = args.batch * (args.warmup + args.batches)
        plan = DrawPlan(
            seed=0, num_samples=total, batch_size=args.batch, box_size=volumes.box_size, crop_size=crop, rotate=True
        )

        def baseline(plan: DrawPlan = plan) -> Any:
            loader = DataLoader(
                ReferenceStyleCrops(path, plan),
                batch_size=args.batch,
                num_workers=args.threads,
                pin_memory=device.type == "cuda",
            )
            return ((inputs.to(device), targets.to(device)) for inputs, targets in loader)

        in_memory = volumes.load()
        cases: dict[str, Any] = {
            "limit": lambda v=in_memory, p=plan: PlainCopies(v, p, args.threads, device=device),
            "baseline": baseline,
        }
        for backend in backends:
            for case in storages:
                if case.endswith("-npy") and npy_volumes is None:
                    continue  # not asked for
                storage = case.removesuffix("-npy")
                settings = LoaderSettings(
                    backend=backend,
                    storage=STORAGES[storage],
                    device_storage_dtype="float16",
                    threads=args.threads,
                    lookahead=2,
                )
                v = npy_volumes if case.endswith("-npy") else volumes
                cases[f"{backend}-{case}"] = lambda s=settings, v=v, p=plan: build_loader(
                    v, p, AUG, settings=s, device=device, dtype=dtype
                )
        if args.cases:
            unknown = sorted(set(args.cases) - set(cases))
            if unknown:
                raise SystemExit(
                    f"python -m bench.pipeline: error: no case {', '.join(unknown)} here ({', '.join(cases)})"
                )
            cases = {case: make for case, make in cases.items() if case in args.cases}
        results: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
        data_files = [path, *(Path(p) for p in (npy_files.inputs, npy_files.targets) if Path(p).exists())]
        for repeat, case in rounds(list(cases), args.repeats):
            if args.cold:
                drop_cached(data_files)
            batches = cases[case]()
            results[case].append(_time_batches(batches, args.warmup, args.batches, device=device, batch=args.batch))
            batches.close()  # its work ahead must not overlap the next case's timing
            rate = results[case][-1]["samples_per_s"]
            print(f"crop {crop}^3, {case}, repeat {repeat + 1}: {rate:.1f} samples/s", flush=True)
            backend, _, storage = case.partition("-")
            records.append(
                {
                    "bench": "pipeline",
                    "case": case,
                    "backend": backend,
                    "storage": storage or LAZY.name,  # the baseline and the limit read the file
                    "crop": crop,
                    "batch": args.batch,
                    "threads": args.threads,
                    "dtype": str(dtype).removeprefix("torch."),
                    "box": volumes.box_size,
                    "repeats": len(results[case]),
                    **rate_summary([r["samples_per_s"] for r in results[case]]),
                    **env,
                }
            )
            append_records(args.out, records[-1:])
    return records


def _latest_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the newest run on each device (a run's records share its start time), the last one of each
    case (the one over the most repeats)."""
    latest: dict[str, str] = {}
    for r in records:
        latest[r["device"]] = max(latest.get(r["device"], ""), r["time"])
    last = {(r["device"], r["crop"], r["case"]): r for r in records if r["time"] == latest[r["device"]]}
    return list(last.values())


def table(records: list[dict[str, Any]]) -> str:
    """A markdown table of the newest run per device, with each case's ratio to that run's baseline."""
    lines = []
    for device in sorted({r["device"] for r in records}):
        rows = [r for r in records if r["device"] == device]
        first = rows[0]
        lines += [
            f"{device} ({first['cpu']}, {first['cores']} cores), {first['box']}^3 box, batch {first['batch']}, "
            f"{first['threads']} threads/workers, {first['dtype']} inputs; torch {first['torch']}, "
            f"DALI {first['dali']}, measured {first['time']}",
            "",
            "| crop | case | samples/s (median) | min - max | vs baseline | of the limit |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for crop in sorted({r["crop"] for r in rows}):
            rate = {r["case"]: r["samples_per_s"] for r in rows if r["crop"] == crop}
            for r in sorted((r for r in rows if r["crop"] == crop), key=lambda r: -r["samples_per_s"]):
                spread = f"{r['samples_per_s_min']:.0f} - {r['samples_per_s_max']:.0f}"
                of_limit = f"{r['samples_per_s'] / rate['limit']:.0%}" if "limit" in rate else "-"
                vs_baseline = f"{r['samples_per_s'] / rate['baseline']:.2f}x" if "baseline" in rate else "-"
                lines.append(
                    f"| {crop}^3 | {r['case']} | {r['samples_per_s']:.1f} | {spread} | {vs_baseline} | {of_limit} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        type=output_file,
        default=REPO / "data" / "bench" / "train_256.h5",
        help="HDF5 box (written if missing)",
    )
    parser.add_argument("--box", type=int, default=256, help="side of the synthetic box written when --data is missing")
    parser.add_argument("--crops", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=len(__import__("os").sched_getaffinity(0)),
        help="pipeline threads = baseline workers",
    )
    parser.add_argument("--warmup", type=int, default=3, help="batches discarded before timing")
    parser.add_argument("--batches", type=int, default=20, help="batches timed per case and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case; the median is reported")
    parser.add_argument("--no_dali", action="store_true", help="torch backend only (machines without DALI)")
    parser.add_argument(
        "--cold", action="store_true", help="drop the data files' pages from the cache before each case"
    )
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="instead: crops/s per reading thread of each file layout, warm and cold (bench/results/layouts.jsonl)",
    )
    parser.add_argument("--cases", nargs="+", help="only these cases (limit, baseline, dali-device, torch-host...)")
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    parser.add_argument(
        "--report", action="store_true", help=f"only regenerate the table in {DOC.relative_to(REPO)} from --out"
    )
    parser.add_argument(
        "--doc",
        type=existing_file,
        help=f"markdown page whose table to regenerate (default: {DOC.relative_to(REPO)}, "
        "with --report or when --out is the default results file)",
    )
    args = parser.parse_args(argv)
    if args.layouts:
        from bench.layouts import main as layouts_main

        layouts_main(args, crop=max(args.crops), out=LAYOUTS if args.out == RESULTS else args.out)
        return
    if not args.report:
        run(args)
    records = read_records(args.out)
    text = table(_latest_run(records))
    print(text)
    doc = args.doc or (DOC if args.report or args.out == RESULTS else None)
    if doc is None:  # a run of one's own, kept apart from the project's results
        print(f"{DOC.relative_to(REPO)} not updated: --report --out {args.out} puts this table there")
    else:
        update_doc(doc, text)


if __name__ == "__main__":
    main()
