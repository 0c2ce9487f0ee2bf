import json

import h5py
import numpy as np
import pytest

from pipeline.layout import HYDRO_CHANNELS, LOG_DENSITY_SCALE, NBODY_CHANNELS
from pipeline.synthetic import SyntheticSpec, _expected_moments, _spectrum_shape, ensure_box, generate_box, write_box
from pipeline.volumes import DataError

SPEC = SyntheticSpec(train_box_size=32, val_box_size=32, seed=5)


@pytest.fixture(scope="module")
def box():
    return generate_box(SPEC, 48, seed=5)


def test_deterministic_for_a_seed_and_different_across_seeds(box):
    again = generate_box(SPEC, 48, seed=5)
    other = generate_box(SPEC, 48, seed=6)
    assert all(np.array_equal(a, b) for a, b in zip(box, again, strict=True))
    assert not np.allclose(box[0], other[0])


def test_layout_and_range(box):
    nbody, hydro = box
    assert nbody.shape == (4, 48, 48, 48) and hydro.shape == (5, 48, 48, 48)
    assert nbody.dtype == hydro.dtype == np.float32
    # Targets must lie inside tanh's range; inputs roughly within [-1, 1] like the reference's.
    assert np.abs(hydro).max() < 1.0
    assert np.mean(np.abs(nbody) < 1.0) > 0.999
    for channels in (nbody, hydro):
        assert np.all(channels.std(axis=(1, 2, 3)) > 0.02)  # no dead channel


def test_velocities_follow_linear_theory(box):
    # v_k = i k / k^2 delta_k gives div v = -delta: exactly anti-correlated with log density.
    nbody, _ = box
    n = nbody.shape[1]
    k = 2 * np.pi * np.fft.fftfreq(n)
    k_along = [k.reshape([-1 if b == a else 1 for b in range(3)]) for a in range(3)]
    div = sum(
        np.real(np.fft.ifft(1j * k_along[a] * np.fft.fft(nbody[1 + a].astype(np.float64), axis=a), axis=a))
        for a in range(3)
    )
    assert np.corrcoef(div.ravel(), nbody[0].ravel())[0, 1] < -0.99


def test_density_has_the_requested_spectrum():
    n = 64
    nbody, _ = generate_box(SPEC, n, seed=7)
    delta = nbody[0].astype(np.float64) * LOG_DENSITY_SCALE
    power = np.abs(np.fft.rfftn(delta - delta.mean())) ** 2 / n**3
    kx, ky = (2 * np.pi * np.fft.fftfreq(n) for _ in range(2))
    kz = 2 * np.pi * np.fft.rfftfreq(n)
    kmag = np.sqrt(kx[:, None, None] ** 2 + ky[None, :, None] ** 2 + kz[None, None, :] ** 2)
    var_delta, _ = _expected_moments(SPEC)
    expected = _spectrum_shape(kmag, SPEC) * SPEC.sigma_log_density**2 / var_delta
    for lo, hi in ((0.4, 0.7), (0.7, 1.0), (1.0, 1.5)):  # shells with thousands of modes: little cosmic variance
        shell = (kmag >= lo) & (kmag < hi)
        assert power[shell].mean() / expected[shell].mean() == pytest.approx(1.0, rel=0.1)


def test_temperature_density_relation_where_gas_is_not_compressed(box):
    _, hydro = box
    log10_rho = hydro[0].astype(np.float64) * LOG_DENSITY_SCALE / np.log(10)
    log10_t = hydro[4].astype(np.float64) * SPEC.temperature_log_range
    # Without shock heating log10(T/T0) = (gamma - 1) log10(rho): the smallest excess over that line is 0.
    excess = log10_t - (SPEC.gamma - 1) * log10_rho
    assert excess.min() == pytest.approx(0.0, abs=1e-5)
    assert np.mean(excess < 1e-5) > 0.3  # expanding regions are on the line exactly
    assert excess.max() > 0.1  # converging regions are heated


def test_written_file_has_reference_layout_and_attributes(tmp_path):
    path = tmp_path / "box.h5"
    write_box(path, SPEC, 32, seed=5)
    with h5py.File(path) as f:
        assert f["Nbody"].shape == (4, 32, 32, 32) and f["Hydro"].shape == (5, 32, 32, 32)
        assert f["Nbody"].dtype == np.float32
        assert json.loads(f["Nbody"].attrs["channels"]) == list(NBODY_CHANNELS)
        assert json.loads(f["Hydro"].attrs["channels"]) == list(HYDRO_CHANNELS)
        assert f.attrs["seed"] == 5 and f.attrs["box_size"] == 32
        assert json.loads(f.attrs["spec"])["gamma"] == SPEC.gamma
        nbody = f["Nbody"][...]
    assert np.array_equal(nbody, generate_box(SPEC, 32, seed=5)[0])
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    assert path.stat().st_mode & 0o044  # readable by others, as the umask allows


def test_ensure_box_reuses_a_matching_file_and_refuses_another(tmp_path):
    path = tmp_path / "val.h5"
    assert ensure_box(path, SPEC, "val") is True
    assert ensure_box(path, SPEC, "val") is False
    with pytest.raises(DataError, match="not generated from this config"):
        ensure_box(path, SyntheticSpec(train_box_size=32, val_box_size=32, seed=9), "val")
