"""The evaluation of a predicted box, bounded in memory: the same metrics as before within 1e-4 relative, on a fixed
truth and prediction (tests/golden/metrics_48.json, written by the evaluation that held every field at once)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model.metrics import Normalization, compare
from pipeline.synthetic import SyntheticSpec, _attributes, generate_box
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden" / "metrics_48.json"


def _truth_and_prediction():
    """The golden file's recipe: a 48^3 toy box and a prediction that is off by a little of everything."""
    spec = SyntheticSpec(train_box_size=48, val_box_size=48, seed=5)
    _, hydro = generate_box(spec, 48, 5)
    noise = np.random.default_rng(7).standard_normal(hydro.shape).astype(np.float32)
    pred = (0.9 * hydro + 0.02 * noise + 0.01 * np.roll(hydro, 1, axis=1)).astype(np.float32)
    return pred, hydro, Normalization.from_attrs(_attributes(spec, 48, 5))


def _close(got, expected, path=""):
    if isinstance(expected, dict):
        assert set(got) == set(expected), path
        for key in expected:
            _close(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _close(g, e, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-9), path
    else:
        assert got == expected, path


def _resolved(metrics):
    """The metrics with each spectrum cut at the truth's cut-off: beyond it (power below 1e-6 of its peak) a ratio is
    rounding over nothing, and float32 fields round each voxel by 1e-7 of the field."""
    for field in ("gas_density", "temperature", "vx", "vy", "vz", "speed"):
        last = metrics[field]["truth_cutoff_k"] or len(metrics[field]["k"])
        for stat in ("power_ratio", "r"):
            metrics[field][stat] = metrics[field][stat][:last]
    return metrics


def test_the_metrics_are_todays_within_1e_4():
    pred, true, norm = _truth_and_prediction()
    got = json.loads(json.dumps(compare(pred, true, norm)))
    expected = json.loads(GOLDEN.read_text())["metrics"]
    assert got["gas_density"]["truth_cutoff_k"] == expected["gas_density"]["truth_cutoff_k"] < 24  # some are cut
    _close(_resolved(got), _resolved(expected))
