"""studies.transfer: the gain fitted on the training box at the same physical scale, judged by the tight target."""

import json

import pytest

from studies.transfer import calibrated, judge, main


def _spectra(ratios, r=0.995):
    return {"k": list(range(1, len(ratios) + 1)), "power_ratio": list(ratios), "r": [r] * len(ratios)}


def test_the_gain_comes_from_the_training_box_at_the_same_scale():
    """The training box has twice the side: its shell 2k is the validation box's shell k."""
    val = _spectra([0.9, 0.8, 0.7, 0.6])
    train = _spectra([1.0, 0.9, 0.5, 0.8, 0.2, 0.7, 0.1, 0.6])
    assert calibrated(val, train) == pytest.approx([1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="not a multiple"):
        calibrated(_spectra([0.9, 0.9, 0.9]), _spectra([1.0] * 4))


def test_the_tight_target_is_per_field():
    assert judge("temperature", [0.96, 1.04], [0.99, 0.995])["met"] is True
    assert judge("temperature", [0.94, 1.0], [0.995, 0.995])["met"] is False
    assert judge("temperature", [1.0, 1.0], [0.989, 0.995])["met"] is False
    assert judge("gas_density", [0.96, 1.0], [0.995, 0.995])["met"] is False
    assert judge("vx", [0.96, 1.04], [0.975, 0.98])["met"] is True
    assert judge("temperature", [1.0, None], [0.995, 0.995])["met"] is None


def test_a_run_is_judged_before_and_after_and_recorded(tmp_path, capsys):
    run = tmp_path / "science-baseline-u20-seed2"
    val = {f: _spectra([1.0] * 8 + [0.5] * 8) for f in ("gas_density", "vx", "vy", "vz")}
    val["temperature"] = _spectra([0.98, 0.96, 0.94, 0.92, 0.9, 0.9, 0.9, 0.9])
    val["target"] = {"k_max": 4}
    train = {f: _spectra([1.0] * 32) for f in ("gas_density", "vx", "vy", "vz")}
    train["temperature"] = _spectra([0.99, 0.98, 0.98, 0.96, 0.98, 0.94, 0.95, 0.92] + [0.9] * 8)
    for which, metrics in (("prediction", val), ("prediction-train", train)):
        (run / which).mkdir(parents=True)
        (run / which / "metrics.json").write_text(json.dumps(metrics))
    out = tmp_path / "transfer.jsonl"
    main([str(run), "--out", str(out)])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    t = record["fields"]["temperature"]
    assert t["after_per_shell"] == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert (t["before"]["met"], t["after"]["met"], record["met_before"], record["met_after"]) == (
        False,
        True,
        False,
        True,
    )
    assert "| science-baseline-u20-seed2 | 1.000-1.000, 0.995 | 1.000-1.000, 0.995 | 0.920-0.980, 0.995 (no) |" in (
        capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing"), "--out", str(out)])
