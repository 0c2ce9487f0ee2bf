"""Shared fixtures: small synthetic boxes on disk, and a runner for ds_train.py as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.sampling import DrawPlan, SampleDraw
from pipeline.synthetic import SyntheticSpec, boxes, write_box

REPO = Path(__file__).resolve().parent.parent

# Small enough for seconds per run on 2 cores; 16^3 crops need a U-Net of depth 4 at most.
TINY_SPEC = SyntheticSpec(train_box_size=32, val_box_size=32, seed=3)
TINY_ARGS = [
    "--config",
    "debug",
    "--data_size",
    "16",
    "--unet_depth",
    "4",
    "--unet_width",
    "4",
    "--Nsamples",
    "128",
    "--Nsamples_val",
    "32",
    "--global_batch_size",
    "8",
    "--base_batch_size",
    "8",
    "--log_every_steps",
    "4",
    "--num_data_workers",
    "1",
    "--synthetic",
    json.dumps({"train_box_size": 32, "val_box_size": 32, "seed": 3}),
    "--lr_schedule.start_lr",
    "1e-2",
]


@dataclass(frozen=True)
class EveryRotation(DrawPlan):
    """Cycles through all 24 rotations, with corners that differ per epoch and sample."""

    def batch_draws(self, epoch, batch):
        start = batch * self.batch_size
        return [
            SampleDraw(((i * 5 + epoch) % 20, (i * 3) % 24, (i * 7 + 2 * epoch) % 24), i % 24)
            for i in range(start, min(start + self.batch_size, self.num_samples))
        ]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, Path]:
    """Train and val files of TINY_SPEC (32^3 boxes)."""
    root = tmp_path_factory.mktemp("data")
    paths = {}
    for which, (size, seed) in boxes(TINY_SPEC).items():
        paths[which] = root / f"{which}.h5"
        write_box(paths[which], TINY_SPEC, size, seed)
    return paths


def single_process_env() -> dict[str, str]:
    """This environment without a launcher's or Slurm's variables: a child started with it is one process."""
    launched = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "SLURM_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launched)}


def tiny_args(train: Path | str, val: Path | str, run_dir: Path | str, *extra: str) -> list[str]:
    """ds_train.py's options for the tiny config, with these box files (generated on first use) and run directory."""
    return [*TINY_ARGS, "--train_path", str(train), "--val_path", str(val), "--run_dir", str(run_dir), *extra]


def run_train(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ds_train.py in a fresh process from the repository root, as a single process (no launcher)."""
    return subprocess.run(
        [sys.executable, "ds_train.py", *args],
        cwd=REPO,
        env=single_process_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
