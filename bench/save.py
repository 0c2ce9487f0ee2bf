"""What a checkpoint costs the training: the time a save holds the step up, with rank 0's finishing work (fsync,
checksums, rename) in the background or waited for, and the steps that run while it finishes.

    python -m bench.save                       # bs64_opt's model (117 M parameters), micro-batch 1, on this machine

One record in bench/results/save.jsonl.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.env import REPO, append_records, environment
from common.cli import ArgumentParser, output_file
from model import Loss
from trainer.build import build_engine
from trainer.checkpoint import Checkpointer, Position
from trainer.config import build_config, load_named
from trainer.config.sections import Checkpointing
from trainer.dist import DistEnv, init_distributed
from trainer.step import train_step

RESULTS = REPO / "bench" / "results" / "save.jsonl"
ONE_KEPT = Checkpointing(keep=1, every_epochs=0, every_steps=None, every_minutes=None)  # saves made by hand


def _steps(engine: Any, batch: tuple[torch.Tensor, torch.Tensor], count: int) -> list[float]:
    """``count`` optimizer steps on ``batch``, each one's seconds."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        train_step(engine, iter([batch]), loss_fn=Loss())
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bench.save", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="bs64_opt")
    parser.add_argument("--crop", type=int, default=64, help="crop side (a multiple of 2^unet_depth)")
    parser.add_argument("--saves", type=int, default=3, help="saves per way, in turn")
    parser.add_argument("--out", type=output_file, default=RESULTS, help="results file (JSON lines), appended to")
    args = parser.parse_args(argv)
    overrides = {"data_size": str(args.crop), "micro_batch_size": "1", "global_batch_size": "1", "base_batch_size": "1"}
    cfg = build_config(load_named(Path("ds_configs/UNet.yaml"), args.config), overrides)
    dist = DistEnv.from_environ({})
    device = init_distributed(dist, 600.0)
    engine = build_engine(cfg, dist, device).engine
    batch = (torch.randn(1, 4, args.crop, args.crop, args.crop), torch.rand(1, 5, args.crop, args.crop, args.crop))
    _steps(engine, batch, 2)  # warm-up: Adam's state allocated
    held: dict[str, list[float]] = {"background": [], "waited": []}
    after: dict[str, list[float]] = {"background": [], "waited": [], "none": []}
    with tempfile.TemporaryDirectory(dir=REPO / "runs" if (REPO / "runs").is_dir() else None) as run_dir:
        checkpoints = Checkpointer(engine, Path(run_dir), settings=ONE_KEPT, batches_per_epoch=1, agree_every=1)
        for _ in range(args.saves):
            for way in ("none", "background", "waited"):
                if way != "none":
                    start = time.perf_counter()
                    at = Position(step=engine.global_steps, epoch=0, batch_in_epoch=0)
                    checkpoints.save(at, lambda: {"epoch": 0}, wait=way == "waited")
                    held[way].append(time.perf_counter() - start)
                after[way] += _steps(engine, batch, 3)  # the steps that run while rank 0 finishes the save
                checkpoints.finish()
        size = sum(p.stat().st_size for p in Path(run_dir).rglob("*") if p.is_file())
    record = {
        "bench": "save",
        "config": args.config,
        "crop": args.crop,
        "checkpoint_gib": size / 2**30,
        "save_held_s": {way: statistics.median(times) for way, times in held.items()},
        "step_s_after": {way: statistics.median(times) for way, times in after.items()},
        **environment(),
    }
    append_records(args.out, [record])
    print({k: record[k] for k in ("checkpoint_gib", "save_held_s", "step_s_after")}, file=sys.stderr)


if __name__ == "__main__":
    main()
