"""The numerics, pinned: the first training losses and the validation losses of a tiny fixed run, stored in
tests/golden/tiny_run.json, must come out again on every run of the suite.

A change that alters what the trainer computes (the data, the draws, the rotations, the network, its
initialization, the loss, the optimizer, the learning-rate schedule) moves these numbers far beyond the
tolerance; a different CPU or library build moves them in the last digits only. Tolerance: 1e-3 relative per
loss (CPU kernels differ between instruction sets by about 1e-6 relative per step; 16 steps stay well inside).
After an intended change of the numerics, regenerate the file and say why in the commit:

    GOLDEN_UPDATE=1 .venv/bin/python -m pytest tests/test_golden.py
"""

import json
import os
from pathlib import Path

import pytest

from tests.conftest import TINY_ARGS, run_train, tiny_args

GOLDEN = Path(__file__).parent / "golden" / "tiny_run.json"
RTOL = 1e-3
# fp32, torch backend (the default on a CPU), one epoch of 16 optimizer steps, a loss logged at each.
OPTIONS = [
    "--num_epochs",
    "1",
    "--log_every_steps",
    "1",
    "--deepspeed_config",
    "ds_configs/ds_fp32.json",
    "--backend",
    "torch",
]


def _run(tmp_path) -> dict[str, list[float]]:
    data = tmp_path / "data"
    result = run_train(tiny_args(data / "train.h5", data / "val.h5", tmp_path / "run", *OPTIONS))
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return {
        "train_losses": [r["loss/train"] for r in records if "loss/train" in r],
        "val_losses": [r["loss/valid"] for r in records if "loss/valid" in r],
    }


def test_the_first_losses_of_a_tiny_run_are_the_stored_ones(tmp_path):
    got = _run(tmp_path)
    if os.environ.get("GOLDEN_UPDATE"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"options": [*TINY_ARGS, *OPTIONS], **got}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden["options"] == [*TINY_ARGS, *OPTIONS], "the run's options changed: regenerate the file"
    assert len(got["train_losses"]) == len(golden["train_losses"]) == 16
    assert len(got["val_losses"]) == len(golden["val_losses"]) >= 1
    for key in ("train_losses", "val_losses"):
        assert got[key] == pytest.approx(golden[key], rel=RTOL), key
