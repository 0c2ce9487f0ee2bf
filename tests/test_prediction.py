"""Using the trained emulator: tiled prediction, spectra, export, and the predict command end to end."""

import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from common.hold import hold_directory, hold_file
from common.outputs import MARK
from model import UNet, figures
from model.blocks import predict_volume
from model.emulator import Emulator, EmulatorSpec, export, from_run_dir, from_weights
from model.emulator import main as export_main
from model.metrics import Normalization, _shells, compare, contrast, edge_margin, spectra
from model.predict import main as predict_main
from model.report import spectra_table
from model.tiling import Axis, Tiling
from pipeline.convert import main as convert_main
from pipeline.layout import LOG_DENSITY_SCALE
from pipeline.synthetic import SyntheticSpec, write_box
from tests.conftest import REPO, run_train, tiny_args, wait_until

CPU = torch.device("cpu")


def _net(seed=0, width=4, depth=3):
    torch.manual_seed(seed)
    net = UNet(4, 5, width, depth=depth)
    net.init_weights(conv_scale=0.1, conv_bias=0.0)
    return net.eval()


def _smooth_volume(box, seed=0):
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((4, box, box, box))
    k = np.fft.fftfreq(box)
    kernel = np.exp(-((k[:, None, None] ** 2 + k[None, :, None] ** 2 + k[None, None, :] ** 2) * 40))
    return np.real(np.fft.ifftn(np.fft.fftn(noise, axes=(1, 2, 3)) * kernel, axes=(1, 2, 3))).astype(np.float32) * 5


def _predicted(net, volume, *, overlap=4, crop=16, **tiling):
    """The whole box blended from tiles, as model.predict and the validation's science metrics blend it."""
    out = np.empty((5, *volume.shape[1:]), np.float32)
    tiles = Tiling(shape=volume.shape[1:], crop=crop, overlap=overlap, **tiling)
    predict_volume(net, volume, tiles, out=out, batch=8, device=CPU)
    return out


def test_tiling_reproduces_the_direct_prediction_when_the_box_fits_in_one_crop():
    net, volume = _net(), _smooth_volume(16)
    with torch.no_grad():
        direct = net(torch.from_numpy(volume)[None])[0].numpy()
    assert np.array_equal(_predicted(net, volume, overlap=4), direct)


def test_tiles_read_the_box_wrapped_or_mirrored_about_its_faces():
    """Along a periodic axis the tiles wrap around; along one that is not, they read the mirror image of the box
    about its face (numpy's "symmetric" padding), the vector component along that axis negated."""
    volume = np.arange(4 * 5 * 6 * 7, dtype=np.float32).reshape(4, 5, 6, 7)
    tiling = Tiling(shape=(5, 6, 7), crop=4, overlap=1, periodic=(True, False, False), pad=2, vectors=((1, 2, 3),))
    got = tiling.read(volume, (3, -2, -3), (9, 10, 13))
    expected = np.pad(volume, ((0, 0), (0, 0), (2, 2), (3, 3)), mode="symmetric")
    expected = np.take(expected, [(3 + i) % 5 for i in range(9)], axis=1, mode="wrap")
    mirrored_y = np.r_[[True] * 2, [False] * 6, [True] * 2]
    mirrored_z = np.r_[[True] * 3, [False] * 7, [True] * 3]
    expected[2, :, mirrored_y] *= -1
    expected[3, :, :, mirrored_z] *= -1
    assert np.array_equal(got, expected)
    assert Axis(size=48, crop=16, overlap=4, periodic=True).starts == [0, 12, 24, 36]
    assert Axis(size=16, crop=16, overlap=4, periodic=True).starts == [0]
    assert Axis(size=40, crop=16, overlap=4, periodic=False, pad=4).starts == [-4, 8, 20, 32]  # to 48: 40 + 2 pads
    assert tiling.blocks == [(0, 3), (3, 5)] and tiling.rows_reaching(1) == [0, 1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for two epochs: its mapping is local, and crop faces are where it errs. Its run directory
    holds a file of the user's, which the run, told to write beside it, leaves as it was."""
    root = tmp_path_factory.mktemp("trained")
    data, run = root / "data", root / "run"
    run.mkdir()
    (run / "notes.txt").write_text("the user's")
    result = run_train(tiny_args(data / "train.h5", data / "val.h5", run, "--num_epochs", "2", "--beside"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run / "notes.txt").read_text() == "the user's"
    return {"run": run, "train": data / "train.h5", "val": data / "val.h5"}


def _centre_reference(net, volume, crop, centre):
    """Every voxel predicted from the central centre^3 block of a tile around it: the most context a crop gives."""
    box, offset = volume.shape[1], (crop - centre) // 2
    out = np.zeros((5,) + volume.shape[1:], np.float32)
    corners = list(itertools.product(range(0, box, centre), repeat=3))
    with torch.no_grad():
        for first in range(0, len(corners), 128):
            group = corners[first : first + 128]
            tiles = [_wrapped(volume, [c - offset for c in corner], crop) for corner in group]
            for (x, y, z), p in zip(group, net(torch.from_numpy(np.stack(tiles))).numpy(), strict=True):
                out[:, x : x + centre, y : y + centre, z : z + centre] = p[
                    :, offset : offset + centre, offset : offset + centre, offset : offset + centre
                ]
    return out


def _wrapped(volume, corner, size):
    """The (C, size^3) window of a periodic volume at ``corner``."""
    index = [np.arange(c, c + size) % n for c, n in zip(corner, volume.shape[1:], strict=True)]
    return volume[:, index[0]][:, :, index[1]][:, :, :, index[2]]


def _seam_ratio(pred, reference, starts):
    """Error on the planes either side of a tile face over the median error per plane (along axis 1)."""
    error = np.abs(pred - reference).mean(axis=(0, 2, 3))
    faces = sorted({s % len(error) for s in starts} | {(s - 1) % len(error) for s in starts})
    return error[faces].mean() / np.median(error)


def test_a_box_of_one_repeated_crop_is_predicted_without_seams(trained):
    net = from_run_dir(trained["run"]).model
    with h5py.File(trained["val"]) as f:
        volume = np.tile(f["Nbody"][:, :16, :16, :16], (1, 3, 3, 3))  # one crop, repeated: a periodic box
    reference = _centre_reference(net, volume, crop=16, centre=4)
    blended, hard = _predicted(net, volume, overlap=6), _predicted(net, volume, overlap=0)
    assert _seam_ratio(blended, reference, Axis(size=48, crop=16, overlap=6, periodic=True).starts) < 1.3
    # The check can fail: tiles that do not overlap show their faces (measured: about 3).
    assert _seam_ratio(hard, reference, Axis(size=48, crop=16, overlap=0, periodic=True).starts) > 1.5
    assert np.abs(blended - reference).mean() < np.abs(hard - reference).mean()


def test_power_spectrum_of_a_plane_wave():
    n, m, amplitude = 32, 5, 0.3
    x = np.arange(n)
    field = 1.0 + amplitude * np.cos(2 * np.pi * m * x / n)[:, None, None] * np.ones((n, n, n))
    s = spectra(contrast(field))
    assert np.flatnonzero(s["p_a"] > 1e-12).tolist() == [m - 1]  # all the power in shell k = m
    # Per mode: the shell's power times its number of modes, over the grid's, is the field's variance.
    assert s["p_a"][m - 1] * s["modes"][m - 1] / n**3 == pytest.approx(amplitude**2 / 2, rel=1e-9)


def test_power_spectrum_of_white_noise_is_flat_at_its_variance():
    rng = np.random.default_rng(0)
    sigma = 0.7
    s = spectra(rng.normal(0.0, sigma, (48, 48, 48)))
    k = s["k"]
    assert s["p_a"][k >= 4] == pytest.approx(np.full((k >= 4).sum(), sigma**2), rel=0.12)
    assert s["p_a"][k >= 4].mean() == pytest.approx(sigma**2, rel=0.02)


def test_power_spectra_of_a_box_of_three_sides_take_shells_of_its_shortest_sides_fundamental():
    """A 24 x 24 x 72 grid: k in units of 2 pi / 24, so a wave of 6 periods along the long side is in shell k = 2,
    and white noise is flat at its variance up to the short sides' Nyquist, 12."""
    shape, amplitude = (24, 24, 72), 0.3
    z = np.arange(shape[2])
    wave = amplitude * np.cos(2 * np.pi * 6 * z / shape[2]) * np.ones(shape)
    s = spectra(wave)
    assert s["k"].tolist() == list(range(1, 13)) and np.flatnonzero(s["p_a"] > 1e-12).tolist() == [1]
    assert s["p_a"][1] * s["modes"][1] / np.prod(shape) == pytest.approx(amplitude**2 / 2, rel=1e-9)
    noise = spectra(np.random.default_rng(0).normal(0.0, 0.5, shape))
    assert np.average(noise["p_a"][2:], weights=noise["modes"][2:]) == pytest.approx(0.25, rel=0.02)  # per mode
    assert _shells(shape)[1] == 12 and _shells(shape)[0].shape == (24, 24, 37)


def test_a_box_that_is_not_periodic_gets_l1_by_distance_from_its_faces_not_spectra():
    rng = np.random.default_rng(3)
    true = rng.normal(0, 0.1, (5, 10, 8, 12)).astype(np.float32)
    error = np.full(10, 0.01, dtype=np.float32)
    error[[0, 9]] = 0.05  # worse on the two faces along x, the only axis that is not periodic
    metrics = compare(true + error[None, :, None, None], true, Normalization(3.0), periodic=(False, True, True))
    assert "gas_density" not in metrics and "target" not in metrics and metrics["spectra"].startswith("not applicable")
    edges = metrics["edges"]
    assert edges["distance"] == [0, 1, 2, 3, 4] and edges["voxels"] == [2 * 8 * 12] * 5
    assert edges["l1_mean"] == pytest.approx([0.05, 0.01, 0.01, 0.01, 0.01], rel=1e-5)
    assert metrics["l1_mean"] == pytest.approx(0.018, rel=1e-5) and "log_density_pdf" in metrics
    assert edge_margin(edges, interior_from=3) == 1 and edge_margin(edges, interior_from=9) is None
    assert spectra_table(metrics).startswith("spectra, r(k) and the science target not applicable")


def test_compare_on_identical_and_noisy_boxes():
    rng = np.random.default_rng(2)
    true = rng.normal(0, 0.1, (5, 24, 24, 24)).astype(np.float32)
    norm = Normalization(temperature_log_range=3.0)
    same = compare(true, true, norm)
    assert same["l1_mean"] == 0 and same["log_density_pdf"]["l1_distance"] == 0
    assert np.allclose(same["gas_density"]["r"], 1) and np.allclose(same["temperature"]["power_ratio"], 1)
    noisy = compare(true + rng.normal(0, 0.1, true.shape).astype(np.float32), true, norm)
    assert (
        all(r < 1 for r in noisy["gas_density"]["r"]) and noisy["summary"]["gas_density_power_ratio_large_scales"] > 1
    )
    assert noisy["temperature_units"] == "T / T0" and len(noisy["temperature_density"]["median_log10_T_true"]) == 20


def test_summaries_are_medians_over_named_k_ranges():
    """A model that under-predicts large-scale power is reported as doing so, even where a few shells just above
    are far over (their mean over k up to half Nyquist would say the opposite)."""
    n = 32
    rng = np.random.default_rng(4)
    g = rng.normal(size=(n, n, n))
    shells, _ = _shells(n)
    gain = np.where(shells <= 6, 0.9, 1.0) + np.where((shells >= 7) & (shells <= 8), 1.0, 0.0)  # 0.9, then 2.0
    gain[0, 0, 0] = 1.0
    g_pred = np.fft.irfftn(np.fft.rfftn(g) * gain, s=g.shape, axes=(0, 1, 2))
    true, pred = np.zeros((2, 5, n, n, n))
    for box, field in ((true, g), (pred, g_pred)):
        box[0] = np.log(1.0 + 0.05 * field) / LOG_DENSITY_SCALE  # gas density, normalized as in the files
        box[4] = 0.01 * g  # temperature: the same in both
    metrics = compare(pred.astype(np.float32), true.astype(np.float32), Normalization(temperature_log_range=3.0))
    assert metrics["k_ranges"] == {"large_scales": [1, 2], "intermediate": [3, 8], "small_scales": [9, 16]}
    ratio = np.asarray(metrics["gas_density"]["power_ratio"])
    assert ratio[:6] == pytest.approx(0.81, rel=1e-3) and ratio[6:8] == pytest.approx(4.0, rel=1e-3)
    assert ratio[:8].mean() > 1.5  # what a mean over k = 1..8 would report
    summary = metrics["summary"]
    assert summary["gas_density_power_ratio_large_scales"] == pytest.approx(0.81, rel=1e-3)
    assert summary["gas_density_power_ratio_intermediate"] == pytest.approx(0.81, rel=1e-3)
    assert summary["gas_density_power_ratio_small_scales"] == pytest.approx(1.0, rel=1e-3)
    assert summary["temperature_r_large_scales"] == pytest.approx(1.0)
    table = spectra_table(metrics)
    assert "large scales (k 1-2)" in table and "gas density P/P 0.810" in table
    assert len([line for line in table.splitlines() if re.match(r"^ +\d+ ", line)]) == 16  # a row per k
    # The science target looks at every shell up to a quarter of Nyquist (k 1-4 here): 0.81 misses it, and the
    # temperature, the same in both boxes, meets it.
    target = metrics["target"]
    assert target["k_max"] == 4 and not target["gas_density"]["met"] and target["temperature"]["met"]
    assert target["gas_density"]["power_ratio_min"] == pytest.approx(0.81, rel=1e-3)
    assert "gas density  P/P 0.810-0.810, r >= 1.000: not met" in table and "temperature  P/P 1.000-1.000" in table


def test_summaries_leave_out_the_shells_beyond_the_truths_cut_off():
    """A truth smoothed to nothing above k = 4 (as synthetic gas is) and a prediction with a little noise there: the
    ratio per shell is huge, but the medians say nothing about those shells instead of reporting it."""
    n = 32
    g = np.random.default_rng(5).normal(size=(n, n, n))
    shells, _ = _shells(n)
    smooth = np.fft.irfftn(np.fft.rfftn(g) * (shells <= 4), s=g.shape, axes=(0, 1, 2))
    noisy = smooth + 2e-4 * g  # well above the float32 rounding of the truth's nothing beyond k = 4
    true, pred = np.zeros((2, 5, n, n, n))
    for box, field in ((true, smooth), (pred, noisy)):
        box[0] = np.log(1.0 + 0.05 * field) / LOG_DENSITY_SCALE
        box[4] = 0.01 * g  # temperature: resolved at every k, the same in both
    metrics = compare(pred, true, Normalization(temperature_log_range=3.0))
    assert metrics["gas_density"]["truth_cutoff_k"] == 4 and metrics["temperature"]["truth_cutoff_k"] is None
    assert max(metrics["gas_density"]["power_ratio"][4:]) > 1e3  # what the shells beyond the cut-off would say
    summary = metrics["summary"]
    assert summary["gas_density_power_ratio_large_scales"] == pytest.approx(1.0, abs=1e-3)
    assert summary["gas_density_power_ratio_intermediate"] == pytest.approx(1.0, abs=1e-3)  # k 3-4 only
    assert summary["gas_density_power_ratio_small_scales"] is None
    assert summary["temperature_power_ratio_small_scales"] == pytest.approx(1.0)
    table = spectra_table(metrics)
    assert "beyond the truth's cut-off: gas density from k 5" in table and "gas density P/P -, r -" in table


def _smooth_fields(count, n, seed):
    g = np.random.default_rng(seed).normal(size=(count, n, n, n))
    shells, _ = _shells(n)
    return np.fft.irfftn(np.fft.rfftn(g, axes=(1, 2, 3)) * (shells <= 6), s=(n, n, n), axes=(1, 2, 3))


def test_the_science_target_judges_each_velocity_component_and_reports_the_speed():
    """Density and temperature exact, the flows not: the target's verdict names the components that are off, one
    line per field, and the speed is reported beside them without a verdict. The velocity spectra are of the field
    itself: twice the velocity is four times the power (a contrast would not see it)."""
    n = 32
    fields = _smooth_fields(5, n, seed=6)
    true = np.zeros((5, n, n, n))
    true[0] = np.log(1.0 + 0.05 * fields[0]) / LOG_DENSITY_SCALE
    true[1:4] = 0.1 * fields[1:4]
    true[4] = 0.01 * fields[4]
    pred = true.copy()
    pred[1] = 2 * true[1]  # vx: the right pattern, twice as strong
    pred[3] = true[3] + 0.1 * _smooth_fields(1, n, seed=7)[0]  # vz: another field added
    metrics = compare(pred, true, Normalization(temperature_log_range=3.0))
    target = metrics["target"]
    assert target["fields"] == ["gas_density", "temperature", "vx", "vy", "vz"] and not target["met"]
    assert target["gas_density"]["met"] and target["temperature"]["met"] and target["vy"]["met"]
    assert target["vx"]["power_ratio_min"] == pytest.approx(4.0) and target["vx"]["r_min"] == pytest.approx(1.0)
    assert not target["vx"]["met"] and not target["vz"]["met"] and target["vz"]["r_min"] < 0.95
    assert not target["speed"]["judged"] and target["vz"]["judged"]
    speed = np.sqrt(np.square(true[1:4]).sum(0))
    expected = spectra(np.sqrt(np.square(pred[1:4]).sum(0)), speed)
    assert metrics["speed"]["power_ratio"] == pytest.approx((expected["p_a"] / expected["p_b"]).tolist())
    summary = metrics["summary"]
    assert summary["vx_power_ratio_large_scales"] == pytest.approx(4.0) and summary[
        "vy_r_intermediate"
    ] == pytest.approx(1.0)
    table = spectra_table(metrics)
    verdicts = table[table.index("science target, every shell k 1-4") :].splitlines()
    assert verdicts[1] == "  gas density  P/P 1.000-1.000, r >= 1.000: met"
    assert verdicts[3] == "  vx           P/P 4.000-4.000, r >= 1.000: not met"
    assert verdicts[4] == "  vy           P/P 1.000-1.000, r >= 1.000: met"
    assert verdicts[6].startswith("  speed        P/P ") and verdicts[6].endswith(": reported, not judged")
    assert verdicts[7] == "science target not met by vx, vz"
    assert "large scales (k 1-2)" in table and "vx P/P 4.000, r 1.000; vy P/P 1.000, r 1.000" in table
    true_again = compare(true, true, Normalization(temperature_log_range=3.0))
    assert true_again["target"]["met"] and spectra_table(true_again).endswith("science target met by every field")


def test_a_truth_without_flows_leaves_the_velocities_unjudged(tmp_path):
    """Files whose velocities are all zero: no ratios of nothing, and the report says the velocities are not
    judged instead of failing or writing NaN; the verdict is of the fields judged."""
    n = 16
    fields = _smooth_fields(2, n, seed=8)
    true = np.zeros((5, n, n, n))
    true[0] = np.log(1.0 + 0.05 * fields[0]) / LOG_DENSITY_SCALE
    true[4] = 0.01 * fields[1]
    pred = true.copy()
    pred[1] = 0.01 * fields[1]
    metrics = compare(pred, true, Normalization(temperature_log_range=3.0))
    json.dumps(metrics, allow_nan=False)
    assert metrics["vx"]["truth_cutoff_k"] == 0 and set(metrics["vx"]["power_ratio"]) == {None}
    assert metrics["target"]["vx"]["met"] is None and metrics["summary"]["vx_r_large_scales"] is None
    table = spectra_table(metrics)
    assert "vx           no fluctuations in the truth: not judged" in table and metrics["target"]["met"]
    assert table.endswith("science target met by every judged field")
    assert figures.spectra(metrics, tmp_path / "spectra.png").stat().st_size > 0  # their lines left out, not a failure


def test_export_round_trip_gives_identical_outputs(tmp_path):
    spec = EmulatorSpec(
        in_channels=4,
        out_channels=5,
        width=4,
        depth=3,
        crop_size=16,
        input_vectors=[[1, 2, 3]],
        target_vectors=[[1, 2, 3]],
    )
    emulator = Emulator(spec, _net(seed=5), "test")
    export(emulator, tmp_path / "emulator.pt")
    loaded = from_weights(tmp_path / "emulator.pt")
    x = torch.randn(2, 4, 16, 16, 16)
    with torch.no_grad():
        assert torch.equal(emulator.model(x), loaded.model(x))
    assert loaded.spec == spec
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an exported emulator"):
        from_weights(tmp_path / "other.pt")


def test_predict_command_after_training(trained, tmp_path):
    run, val = trained["run"], trained["val"]
    out = tmp_path / "prediction"
    assert predict_main(["--run_dir", str(run), "--input", str(val), "--out", str(out), "--overlap", "4"]) == 0
    with h5py.File(out / "prediction.h5") as f, h5py.File(val) as truth:
        assert f["Hydro"].shape == truth["Hydro"].shape == (5, 32, 32, 32)
        assert f.attrs["spec"] == truth.attrs["spec"]  # normalization attributes carried over
        assert json.loads(f.attrs["prediction"])["overlap"] == 4
        pred, true = f["Hydro"][...], truth["Hydro"][...]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["l1_mean"] == pytest.approx(np.abs(pred.astype(np.float64) - true).mean(), rel=1e-6)
    assert metrics["l1_mean"] < np.abs(true).mean()  # the trained model beats predicting zero
    assert {"gas_density", "temperature", "log_density_pdf", "temperature_density", "summary"} <= set(metrics)
    planes = metrics["temperature_density_plane"]
    assert sum(map(sum, planes["true"])) == pytest.approx(1.0, abs=0.01)  # fractions of the voxels (0.1-99.9%)
    for png in ("slices.png", "spectra.png", "phases.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert not list(out.glob(".*.npy"))  # the on-disk accumulators are gone
    # The exported file predicts the same box to the bit, without DeepSpeed's checkpoint.
    export(from_run_dir(run), tmp_path / "emulator.pt")
    assert (
        predict_main(
            [
                "--weights",
                str(tmp_path / "emulator.pt"),
                "--input",
                str(val),
                "--out",
                str(tmp_path / "exported"),
                "--overlap",
                "4",
            ]
        )
        == 0
    )
    with h5py.File(tmp_path / "exported" / "prediction.h5") as f:
        assert np.array_equal(f["Hydro"][...], pred)


def test_export_never_replaces_a_file_unasked_and_bad_sources_are_one_line(trained, tmp_path, capsys, caplog):
    run, val = trained["run"], trained["val"]
    out = tmp_path / "emulator.pt"
    assert export_main(["--run_dir", str(run), "--out", str(out)]) == 0
    stamp = out.stat().st_mtime_ns
    assert export_main(["--run_dir", str(run), "--out", str(out)]) == 2
    assert f"{out} exists: --overwrite replaces it" in capsys.readouterr().err and out.stat().st_mtime_ns == stamp
    assert export_main(["--run_dir", str(run), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARK, "emulator.pt"]  # no partial file left
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"config": {"unet_width"')
    for argv, message in [
        (["--run_dir", str(tmp_path)], "not a run directory (no config.json)"),
        (["--run_dir", str(run), "--tag", "step9"], "no checkpoint 'step9' (found: step"),
        (["--run_dir", str(broken)], "config.json: not a run's resolved config (JSONDecodeError"),
    ]:
        assert export_main(["--out", str(tmp_path / "other.pt"), *argv]) == 2  # a later --out wins
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(out.read_bytes()[:10_000])
    for weights, extra, message in [
        (truncated, [], "not a readable torch file"),
        (out, ["--overlap", "-1"], "overlap -1 must be in [0, 16)"),
        (out, ["--batch", "0"], "batch must be positive, got 0"),
    ]:
        caplog.clear()
        assert predict_main(["--weights", str(weights), "--input", str(val), "--out", str(tmp_path / "p"), *extra]) == 2
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and message in errors[0], errors


def test_outputs_another_writer_holds_are_refused_in_one_line(trained, tiny_data, tmp_path, capsys, caplog):
    """model.export, model.predict and pipeline.convert while their output is held (here by this process, as
    another writer would hold it): one line naming the holder, status 2, nothing written."""
    run, val = trained["run"], trained["val"]
    held = f"is held by process {os.getpid()}"
    out = tmp_path / "emulator.pt"
    with hold_file(out, ""):
        assert export_main(["--run_dir", str(run), "--out", str(out)]) == 2
    assert held in capsys.readouterr().err and not out.exists()
    predicted = tmp_path / "prediction"
    with hold_directory(predicted, ""):
        assert predict_main(["--run_dir", str(run), "--input", str(val), "--out", str(predicted)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and held in errors[0] and not (predicted / "prediction.h5").exists()
    with hold_file(tmp_path / "box", ""), pytest.raises(SystemExit) as exit_:
        convert_main([str(tiny_data["train"]), "--out_prefix", str(tmp_path / "box")])
    assert exit_.value.code == 2 and held in capsys.readouterr().err
    assert not list(tmp_path.glob("box_*"))


def test_science_metrics_during_training(trained, tmp_path):
    run = tmp_path / "run"
    result = run_train(
        tiny_args(trained["train"], trained["val"], run, "--num_epochs", "2", "--science_every_epochs", "2")
    )
    assert result.returncode == 0, result.stderr[-2000:]
    science = [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if "science/l1_gas_density" in line
    ]
    assert [r["epoch"] for r in science] == [2]
    logged = {
        "science/gas_density_power_ratio_large_scales",
        "science/temperature_r_small_scales",
        "science/vx_r_large_scales",
    }
    assert logged <= set(science[0]) and None not in science[0].values()
    assert science[0]["science/box_size"] == 32  # the whole validation box


def test_science_metrics_on_a_fixed_sub_volume(trained, tmp_path):
    run = tmp_path / "run"
    result = run_train(
        tiny_args(
            trained["train"],
            trained["val"],
            run,
            "--num_epochs",
            "2",
            "--science_every_epochs",
            "1",
            "--science_box_size",
            "16",
        )
    )
    assert result.returncode == 0, result.stderr[-2000:]
    science = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "science/box_size" in line
    ]
    assert [(r["epoch"], r["science/box_size"]) for r in science] == [(1, 16), (2, 16)]
    assert science[0]["science/l1_gas_density"] != science[1]["science/l1_gas_density"]  # the same box, trained on


def test_predict_reads_npy_inputs(trained, tmp_path):
    from pipeline.convert import convert

    data, _ = convert(trained["val"], tmp_path / "val", "DHWC")
    out = tmp_path / "npy"
    args = [
        "--run_dir",
        str(trained["run"]),
        "--input",
        str(data),
        "--npy_layout",
        "DHWC",
        "--truth",
        str(trained["val"]),
    ]
    assert predict_main([*args, "--out", str(out), "--overlap", "4"]) == 0
    assert (
        predict_main(
            [
                "--run_dir",
                str(trained["run"]),
                "--input",
                str(trained["val"]),
                "--out",
                str(tmp_path / "h5"),
                "--overlap",
                "4",
            ]
        )
        == 0
    )
    with h5py.File(out / "prediction.h5") as a, h5py.File(tmp_path / "h5" / "prediction.h5") as b:
        assert np.array_equal(a["Hydro"][...], b["Hydro"][...])
    assert json.loads((out / "metrics.json").read_text())["l1_mean"] > 0


def test_readers_say_damaged_and_fall_back_from_a_damaged_newest_checkpoint(trained, tmp_path, capsys, caplog):
    """A truncated newest checkpoint: export with its tag is one line saying damaged, naming the file; without a tag
    export and predict take the checkpoint before it, saying so; the run directory is left as it was."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    model = run / "checkpoints" / "step00000032" / "mp_rank_00_model_states.pt"
    model.write_bytes(model.read_bytes()[:1000])
    out = tmp_path / "emulator.pt"
    assert export_main(["--run_dir", str(run), "--tag", "step00000032", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    damaged = r"damaged \(mp_rank_00_model_states.pt truncated: 1,000 of [\d,]+ bytes\)"
    assert re.fullmatch(rf"error: {run}/checkpoints/step00000032: {damaged}", err), err
    assert len(err.splitlines()) == 1 and len(err) - len(str(run)) < 200
    caplog.clear()
    assert export_main(["--run_dir", str(run), "--out", str(out)]) == 0
    assert f"wrote {out} from {run} checkpoint step00000016" in capsys.readouterr().out
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings[0].startswith(f"checkpoint {model.parent} is damaged (mp_rank_00_model_states.pt truncated")
    assert warnings[1] == "using step00000016, the newest intact checkpoint"
    caplog.clear()
    assert predict_main(["--run_dir", str(run), "--input", str(trained["val"]), "--out", str(tmp_path / "p")]) == 0
    assert "using step00000016, the newest intact checkpoint" in caplog.text
    assert model.stat().st_size == 1000 and (run / "checkpoints" / "step00000032").is_dir()  # readers move nothing


def test_an_export_that_cannot_be_written_replaces_nothing(trained, tmp_path):
    """A file size limit the export exceeds (SIGXFSZ ignored: the write fails): one line, status 2, the earlier
    export as it was, no partial file left."""
    out = tmp_path / "emulator.pt"
    assert export_main(["--run_dir", str(trained["run"]), "--out", str(out)]) == 0
    earlier = out.read_bytes()
    script = (
        f"trap '' XFSZ; ulimit -f 16; exec {sys.executable} -m model.export --run_dir {trained['run']} --out {out} "
        "--overwrite"
    )
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith(f"error: {out}: could not be written (")
        and "nothing was replaced" in lines[0]
    )
    assert out.read_bytes() == earlier and sorted(p.name for p in tmp_path.iterdir()) == [MARK, "emulator.pt"]


# --- prediction at any size and shape: slabs, ranks, resuming, sub-volumes, bounded memory --------------------------


@pytest.fixture(scope="module")
def big_box(trained, tmp_path_factory):
    """A periodic 48 x 24 x 72 box (a 24^3 one repeated) for the tiny emulator (16^3 tiles, overlap 4): four rows
    of 2 x 6 tiles, four blocks of planes; its sub-volume of 40 x 24 x 64 from (4, 0, 4), not periodic along x and z,
    and the same from (6, 0, 6)."""
    root = tmp_path_factory.mktemp("big")
    spec = SyntheticSpec(train_box_size=24, val_box_size=24, seed=11)
    write_box(root / "cube.h5", spec, 24, seed=11)
    with h5py.File(root / "cube.h5") as cube:
        fields = {name: np.tile(cube[name][...], (1, 2, 1, 3)) for name in ("Nbody", "Hydro")}
        attrs = dict(cube.attrs)
    paths = {"box": root / "box.h5", "sub": root / "sub.h5", "shifted": root / "shifted.h5"}
    for name, region in (
        ("box", np.s_[:, :, :, :]),
        ("sub", np.s_[:, 4:44, :, 4:68]),
        ("shifted", np.s_[:, 6:46, :, 6:70]),
    ):
        with h5py.File(paths[name], "w") as f:
            f.attrs.update(attrs)
            for dataset, values in fields.items():
                f[dataset] = values[region]
    export(from_run_dir(trained["run"]), root / "emulator.pt")
    return {**paths, "weights": root / "emulator.pt"}


MIRRORED = ("--boundary", "mirror,periodic,mirror", "--pad", "4")


@pytest.fixture(scope="module")
def one_rank(big_box, tmp_path_factory):
    """The box predicted by one rank, a slab file per block: what the other ways must give."""
    out = tmp_path_factory.mktemp("one") / "prediction"
    result = _predict(big_box, out, "--slab_blocks", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    return _hydro(out)


@pytest.fixture(scope="module")
def sub_volume(big_box, tmp_path_factory):
    """The sub-volume predicted by one rank with mirrored faces, and evaluated against its truth."""
    out = tmp_path_factory.mktemp("sub") / "prediction"
    result = _predict(big_box, out, "--slab_blocks", "1", *MIRRORED, input_=big_box["sub"])
    assert result.returncode == 0, result.stderr[-3000:]
    return {"out": out, "hydro": _hydro(out), "stdout": result.stdout}


def _predict(big_box, out, *extra, launcher=(), input_=None):
    command = [*launcher, "-m", "model.predict"] if launcher else [sys.executable, "-m", "model.predict"]
    source = input_ or big_box["box"]
    args = ["--weights", str(big_box["weights"]), "--input", str(source), "--out", str(out), *extra]
    return subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _hydro(out):
    with h5py.File(out / "prediction.h5", "r", locking=False) as f:
        return f["Hydro"][...]


def test_two_ranks_predict_what_one_does_into_one_dataset_of_chunked_slabs(big_box, one_rank, tmp_path):
    two = _predict(
        big_box,
        tmp_path / "two",
        *("--slab_blocks", "1", "--compression", "gzip"),
        launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = one_rank, _hydro(tmp_path / "two")
    assert a.shape == (5, 48, 24, 72) and np.isfinite(a).all()
    assert (np.abs(a - b).max(axis=(1, 2, 3)) <= 1e-5 * a.std(axis=(1, 2, 3))).all()
    with h5py.File(tmp_path / "two" / "prediction.h5", "r", locking=False) as f:
        assert f["Hydro"].is_virtual and len(f["Hydro"].virtual_sources()) == 4  # a slab file per block
        info = json.loads(f.attrs["prediction"])
        # four rows of 2 x 6 tiles: each rank takes the rows that reach its two blocks, one more than its own
        assert len(info["ranks"]) == 2 and all(r["tiles"] == 3 * 12 for r in info["ranks"])
        assert info["shape"] == [48, 24, 72] and info["boundary"] == ["periodic"] * 3 and info["margin"]["voxels"] == 0
    slab = sorted((tmp_path / "two" / "prediction.slabs").glob("slab-*.h5"))[0]
    with h5py.File(slab, "r", locking=False) as f:
        assert f["Hydro"].chunks == (1, 12, 24, 64) and f["Hydro"].compression == "gzip"
    assert "2 slab(s) of 2 to do here" in two.stderr
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())  # shells of 2 pi / 24, to Nyquist 12
    assert metrics["gas_density"]["k"] == list(range(1, 13)) and metrics["target"]["k_max"] == 3


def test_a_killed_prediction_of_a_sub_volume_continues_from_its_finished_slabs_to_the_same_values(
    big_box, sub_volume, tmp_path
):
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "model.predict", "--weights", str(big_box["weights"]), *MIRRORED, "--input"]
    proc = subprocess.Popen(
        [*command, str(big_box["sub"]), "--out", str(out), "--slab_blocks", "1", "--batch", "1"], cwd=REPO
    )
    try:
        wait_until(proc, lambda: len(list((out / "prediction.slabs").glob("slab-*.h5"))) >= 2, 120, "no slab written")
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    assert not (out / "prediction.h5").exists()  # nothing under the final name before the whole is there
    resumed = _predict(big_box, out, "--slab_blocks", "1", *MIRRORED, input_=big_box["sub"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = int(re.search(r"(\d) slab\(s\) of 4 to do here", resumed.stderr)[1])
    assert done <= 2  # the finished ones kept
    assert np.array_equal(_hydro(out), sub_volume["hydro"])


def _interior(values, crop=16):
    """The voxels of a sub-volume's prediction a crop or more from its faces along x and z."""
    return values[:, crop:-crop, :, crop:-crop]


def test_a_sub_volume_predicts_the_whole_boxs_values_inside_and_says_its_margin(big_box, one_rank, sub_volume):
    """Cut at (4, 0, 4), the sub-volume's tiles fall on the whole box's grid (they start a pad of 4 before it): a
    crop or more from its faces it predicts the whole box's values, to float rounding. At its faces its error
    against the truth is measured by distance, and the margin where it exceeds the interior's by 10% given."""
    sub, whole = sub_volume["hydro"], one_rank[:, 4:44, :, 4:68]
    spread = whole.std(axis=(1, 2, 3))[:, None, None, None]
    assert sub.shape == (5, 40, 24, 64) and np.isfinite(sub).all()
    assert (np.abs(_interior(sub) - _interior(whole)) <= 1e-5 * spread).all()
    assert (np.abs(sub - whole).max(axis=(1, 2, 3)) > 1e-3 * spread.ravel()).any()  # the faces see mirrored context
    metrics = json.loads((sub_volume["out"] / "metrics.json").read_text())
    with h5py.File(big_box["sub"]) as f:
        truth = f["Hydro"][...]
    distance = np.minimum.outer(
        np.minimum(np.arange(40), np.arange(40)[::-1]), np.minimum(np.arange(64), np.arange(64)[::-1])
    )
    error = np.abs(sub.astype(np.float64) - truth).mean(axis=(0, 2))  # (x, z)
    edges = metrics["edges"]
    expected = [error[distance == d].mean() for d in edges["distance"]]
    assert edges["distance"] == list(range(20)) and edges["l1_mean"] == pytest.approx(expected, rel=1e-6)
    interior = np.average(np.asarray(edges["l1_mean"])[16:], weights=np.asarray(edges["voxels"])[16:])
    found = metrics["margin"]["voxels"]
    assert 0 <= found <= 16 and all(v <= 1.1 * interior for v in edges["l1_mean"][found:16])
    assert found == 0 or edges["l1_mean"][found - 1] > 1.1 * interior
    assert "gas_density" not in metrics and metrics["spectra"].startswith("not applicable")
    assert "spectra, r(k) and the science target not applicable" in sub_volume["stdout"]
    assert not (sub_volume["out"] / "spectra.png").exists() and (sub_volume["out"] / "phases.png").is_file()
    with h5py.File(sub_volume["out"] / "prediction.h5", "r", locking=False) as f:
        info = json.loads(f.attrs["prediction"])
    assert info["boundary"] == ["mirror", "periodic", "mirror"] and info["pad"] == 4 and info["margin"]["voxels"] == 1


def test_a_sub_volume_off_the_whole_boxs_grid_differs_inside_by_no_more_than_moving_the_grid(big_box, one_rank):
    """Cut at (6, 0, 6), its tiles start 2 voxels off the whole box's grid: inside, it differs from the whole box's
    prediction as much as the whole box predicted on a grid moved by 2 does, and equals that one to float rounding."""
    net = from_weights(big_box["weights"]).model
    with h5py.File(big_box["box"]) as f:
        volume = f["Nbody"][...]
    with h5py.File(big_box["shifted"]) as f:
        cut = f["Nbody"][...]
    moved = np.roll(_predicted(net, np.roll(volume, -2, axis=(1, 3))), 2, axis=(1, 3))[:, 6:46, :, 6:70]
    sub = _predicted(net, cut, overlap=4, periodic=(False, True, False), pad=4)
    whole = one_rank[:, 6:46, :, 6:70]
    spread = np.abs(_interior(moved) - _interior(whole)).max(axis=(1, 2, 3))
    scale = whole.std(axis=(1, 2, 3))
    assert (spread > 1e-4 * scale).all()  # moving the grid moves the values
    assert (np.abs(_interior(sub) - _interior(moved)).max(axis=(1, 2, 3)) <= 1e-5 * scale).all()
    assert (np.abs(_interior(sub) - _interior(whole)).max(axis=(1, 2, 3)) <= spread + 1e-5 * scale).all()


MEMORY = """
import json, sys, h5py, numpy as np
from model.metrics import Normalization, compare
f, g = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
before = hwm()
compare(f["Hydro"], g["Hydro"], Normalization(3.0))
print(json.dumps({"peak_bytes": hwm() - before}))
"""


def test_the_evaluation_of_a_box_held_on_disk_stays_within_32_bytes_a_voxel(tmp_path):
    """A 128^3 box read from files: the evaluation's peak (resident memory above what the process held before) per
    voxel of the box. Holding every field at once took 207-222 bytes a voxel."""
    n = 128
    rng = np.random.default_rng(3)
    for name in ("pred", "true"):
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            hydro = f.create_dataset("Hydro", shape=(5, n, n, n), dtype=np.float32)
            for c in range(5):
                hydro[c] = rng.uniform(-0.3, 0.3, (n, n, n)).astype(np.float32)
    result = subprocess.run(
        [sys.executable, "-c", MEMORY, str(tmp_path / "pred.h5"), str(tmp_path / "true.h5")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    per_voxel = json.loads(result.stdout)["peak_bytes"] / n**3
    assert per_voxel <= 32, per_voxel
