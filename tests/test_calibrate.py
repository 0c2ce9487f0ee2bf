"""model.calibrate: gains fitted on one box's smoothed prediction put the power back there and on another box, and
leave the phases (r) as they were."""

import json

import h5py
import numpy as np
import pytest
import torch

from model.calibrate import FIELDS, TOLERANCE, apply, fit, main
from model.metrics import Normalization, compare
from pipeline.layout import GAS_DENSITY, HYDRO_DATASET, TEMPERATURE

NORM = Normalization(3.0)
SIDE = 32


def _universe(seed: int, side: int = SIDE) -> tuple[np.ndarray, np.ndarray]:
    """A true normalized (5, 32, 32, 32) box with log-normal gas density and temperature and Gaussian flows, and a
    prediction that is a copy of it with every scale's amplitude shrunk the more the smaller the scale."""
    rng = np.random.default_rng(seed)
    k = np.sqrt(sum(f**2 for f in np.meshgrid(*[np.fft.fftfreq(side)] * 2, np.fft.rfftfreq(side), indexing="ij")))
    true = np.zeros((5, side, side, side), dtype=np.float32)
    for channel, amplitude in ((GAS_DENSITY, 0.08), (1, 0.2), (2, 0.2), (3, 0.2), (TEMPERATURE, 0.1)):
        modes = np.fft.rfftn(rng.standard_normal((side,) * 3)) * np.exp(-((k / 0.12) ** 2))
        field = np.fft.irfftn(modes, s=(side,) * 3, axes=(0, 1, 2))
        true[channel] = amplitude * field / field.std()
    shrink = torch.from_numpy((1 - 0.6 * k).astype(np.float32))  # 1 at k = 0, 0.925 at a quarter of Nyquist
    pred = true.copy()
    for channel in range(5):
        pred[channel] = torch.fft.irfftn(torch.fft.rfftn(torch.from_numpy(true[channel])) * shrink, s=(side,) * 3)
    return pred, true


JUDGED = ("gas_density", "temperature", "vx", "vy", "vz")


def _target(pred: np.ndarray, true: np.ndarray) -> dict:
    metrics = compare(pred, true, NORM)
    last = pred.shape[1] // 8
    return {name: (metrics[name]["power_ratio"][:last], metrics[name]["r"][:last]) for name in JUDGED}


def test_gains_fitted_on_one_box_put_the_power_back_there_and_on_another_and_keep_r():
    """Fitted on a 64^3 box, applied to a 32^3 one: the gains go by cycles per voxel, not by shell number."""
    pred, true = _universe(0, side=64)
    calibration = fit(pred, true, NORM)
    before = _target(pred, true)
    assert min(before["temperature"][0]) < 0.85  # the prediction has lost power at the target's scales
    fitted = pred.copy()
    apply(fitted, calibration)
    after = _target(fitted, true)
    for name in JUDGED:  # each velocity component within the tolerance: they share a gain, their power is one
        ratio, r = after[name]
        assert np.abs(np.asarray(ratio) - 1).max() <= (2 if name in FIELDS else 4) * TOLERANCE
        assert np.abs(np.asarray(r) - np.asarray(before[name][1])).max() < 2e-3
    for fitted_field in calibration["fields"].values():
        assert fitted_field["converged"] and fitted_field["iterations"] > 1 and max(fitted_field["gain"]) > 1.05
    other_pred, other_true = _universe(1)
    apply(other_pred, calibration)
    for name in JUDGED:
        assert np.abs(np.asarray(_target(other_pred, other_true)[name][0]) - 1).max() < 0.05


def test_a_truth_without_flows_gets_no_velocity_gains_and_a_prediction_without_them_is_refused():
    pred, true = _universe(0)
    flows = pred[1:4].copy()
    true[1:4] = 0
    calibration = fit(pred, true, NORM)
    assert calibration["fields"]["velocity"] == {"frequency": [], "gain": []}
    apply(pred, calibration)
    assert np.array_equal(pred[1:4], flows) and calibration["fields"]["temperature"]["gain"]
    pred, true = _universe(0)
    pred[1:4] = 0
    with pytest.raises(ValueError, match="velocity: the prediction has no power"):
        fit(pred, true, NORM)


def test_a_prediction_far_off_is_refused():
    pred, true = _universe(0)
    pred[TEMPERATURE] *= 0.05
    with pytest.raises(ValueError, match="temperature: gains .* too far off"):
        fit(pred, true, NORM)


def _write(path, hydro):
    with h5py.File(path, "w") as f:
        f.create_dataset(HYDRO_DATASET, data=hydro)
        f.attrs["spec"] = json.dumps({"temperature_log_range": 3.0})


def test_the_command_fits_applies_and_judges(tmp_path, capsys):
    pred, true = _universe(0)
    other_pred, other_true = _universe(1)
    for name, hydro in (("pred", pred), ("true", true), ("other_pred", other_pred), ("other_true", other_true)):
        _write(tmp_path / f"{name}.h5", hydro)
    gains = tmp_path / "gains.json"
    main(["--fit", str(tmp_path / "pred.h5"), "--truth", str(tmp_path / "true.h5"), "--calibration", str(gains)])
    assert set(json.loads(gains.read_text())["fields"]) == set(FIELDS)
    out = tmp_path / "calibrated"
    main(
        [
            "--calibration",
            str(gains),
            "--apply",
            str(tmp_path / "other_pred.h5"),
            "--truth",
            str(tmp_path / "other_true.h5"),
            "--out",
            str(out),
        ]
    )
    assert "science target" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert np.abs(np.asarray(metrics["temperature"]["power_ratio"][: SIDE // 8]) - 1).max() < 0.05
    with h5py.File(out / "prediction.h5") as f:
        assert f.attrs["calibration"] == str(gains) and f[HYDRO_DATASET].shape == pred.shape
    with pytest.raises(SystemExit):
        main(["--fit", str(tmp_path / "pred.h5"), "--calibration", str(gains)])
    assert "--fit needs --truth" in capsys.readouterr().err
    fitting = ["--fit", str(tmp_path / "pred.h5"), "--truth", str(tmp_path / "true.h5"), "--calibration", str(gains)]
    with pytest.raises(SystemExit, match="exists: --overwrite replaces it"):
        main(fitting)
    main([*fitting, "--overwrite"])
    with pytest.raises(SystemExit):
        main(["--calibration", str(gains), "--apply", str(tmp_path / "pred.h5"), "--out", str(out), "--overwrite"])
    assert "--overwrite goes with --fit" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="never replaces an input"):
        main(["--calibration", str(gains), "--apply", str(out / "prediction.h5"), "--out", str(out)])
    _write(tmp_path / "small.h5", true[:, :16, :16, :16])
    with pytest.raises(SystemExit, match="true hydro .* and prediction .* differ"):
        main(
            [
                "--fit",
                str(tmp_path / "pred.h5"),
                "--truth",
                str(tmp_path / "small.h5"),
                "--calibration",
                str(tmp_path / "other.json"),
            ]
        )
