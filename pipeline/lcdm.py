"""A synthetic universe from a cosmology: LCDM initial conditions, dark matter moved by the Zel'dovich
approximation, and gas that follows it down to a pressure-smoothing scale.

1. The linear matter power spectrum P(k) of a flat LCDM cosmology (Omega_m, Omega_b, h, n_s, sigma_8) at redshift
   0, from colossus's Eisenstein & Hu (1998) transfer function with baryon oscillations, normalized to sigma_8, and
   the linear growth factor D(z). colossus is a small pure-Python package (with SciPy); CAMB or CLASS would be
   about 1% more accurate on these scales at the cost of a compiled code and seconds per spectrum.
2. A Gaussian field with spectrum D(z)^2 P(k) on the periodic grid (cell ``cell_mpc_h`` Mpc/h): the linear density
   delta_k and the Zel'dovich displacement psi_k = i k / k^2 delta_k.
3. One particle per cell, moved to x = q + psi(q); cloud-in-cell deposit of their mass (the dark-matter density
   rho / rho_mean) and of their momentum (the mass-weighted velocity, v = f psi in units of a H, f = Omega_m(z)^0.55).
4. Gas: the dark-matter density and momentum filtered with exp(-k^2 lambda^2 / 2) at the Jeans-like scale
   ``jeans_mpc_h`` (pressure smoothing); temperature from T = T0 (rho_gas)^(gamma - 1) with a log-normal scatter,
   times 1 + (T_shock / T0) (rho_gas / ``shock_density`` - 1) c where the gas is denser than ``shock_density`` and
   converging at c standard deviations of -div v (a shock-heated phase that grows continuously with both).

Normalized the reference's way: densities as log(rho) / 14, velocities over ``velocity_unit_sigmas`` times the
expected linear rms of one component, temperature as log10(T / T0) / ``temperature_log_range``.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from pipeline.layout import LOG_DENSITY_SCALE

_DENSITY_FLOOR = 1e-3  # cells no particle reaches (deep voids) get this density, not log(0)


@functools.cache
def _cosmology(omega_m: float, omega_b: float, h: float, n_s: float, sigma8: float):
    from colossus.cosmology import cosmology  # imported here: only the lcdm universe needs it

    params = {"flat": True, "H0": 100 * h, "Om0": omega_m, "Ob0": omega_b, "sigma8": sigma8, "ns": n_s}
    return cosmology.setCosmology("synthetic", params=params, persistence="")


def linear_power(k_h_mpc: np.ndarray, spec) -> np.ndarray:
    """Linear P(k) in (Mpc/h)^3 at the spec's redshift, for k in h/Mpc (0 where k is 0)."""
    cosmo = _cosmology(spec.omega_m, spec.omega_b, spec.h, spec.n_s, spec.sigma8)
    k = np.asarray(k_h_mpc, dtype=np.float64)
    out = np.zeros_like(k)
    positive = k > 0
    growth = cosmo.growthFactor(spec.redshift)
    out[positive] = cosmo.matterPowerSpectrum(k[positive], 0.0) * growth**2
    return out


def growth_rate(spec) -> float:
    """f = dln D / dln a, by the usual Omega_m(z)^0.55."""
    a3 = (1 + spec.redshift) ** 3
    omega_mz = spec.omega_m * a3 / (spec.omega_m * a3 + 1 - spec.omega_m)
    return omega_mz**0.55


def _wavevectors(n: int, cell: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Wavevectors of the rfft grid in h/Mpc."""
    k1 = 2 * np.pi * np.fft.fftfreq(n, d=cell)
    return k1[:, None, None], k1[None, :, None], (2 * np.pi * np.fft.rfftfreq(n, d=cell))[None, None, :]


def linear_density_k(spec, n: int, seed: int) -> np.ndarray:
    """Fourier modes (rfftn layout) of the linear density contrast on the n^3 grid, at the spec's redshift."""
    cell = spec.cell_mpc_h
    kx, ky, kz = _wavevectors(n, cell)
    k = np.sqrt(kx**2 + ky**2 + kz**2)
    volume = (n * cell) ** 3
    # White noise of unit variance per cell has |W_k|^2 = n^3 on average: scale to <|delta_k|^2> = P(k) n^6 / V.
    noise = np.fft.rfftn(np.random.default_rng(seed).standard_normal((n, n, n)))
    return noise * np.sqrt(linear_power(k, spec) * n**3 / volume)


_SLAB = 16  # planes of particles deposited at a time: bounds the deposit's memory to a few n^2 x 16 arrays


def _deposit(psi: np.ndarray, cell: float, velocity_factor: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """Cloud-in-cell deposit of one particle per cell, moved from its cell q to q + psi(q) (psi (3, n, n, n) in Mpc/h,
    periodic): the density rho / rho_mean and the three momentum components (mass times v = velocity_factor psi).
    Particles go slab by slab of ``_SLAB`` planes, so that memory stays a few grids, whatever n."""
    n = psi.shape[1]
    grids = np.zeros((4, n**3))  # mass, then momentum along x, y, z
    plane = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij")).reshape(2, -1)
    for start in range(0, n, _SLAB):
        planes = np.arange(start, min(start + _SLAB, n))
        q = np.concatenate([np.repeat(planes, n * n)[None], np.tile(plane, len(planes))]).astype(np.float64)
        displacement = psi[:, planes].reshape(3, -1)
        position = q + displacement / cell
        base = np.floor(position)
        frac = position - base
        base = base.astype(np.int64)
        values = np.concatenate([np.ones((1, base.shape[1])), velocity_factor * displacement])
        for corner in range(8):
            offset = np.array([(corner >> 2) & 1, (corner >> 1) & 1, corner & 1])[:, None]
            w = np.prod(np.where(offset, frac, 1 - frac), axis=0)
            idx = (base + offset) % n
            flat = (idx[0] * n + idx[1]) * n + idx[2]
            for g in range(4):
                grids[g] += np.bincount(flat, weights=w * values[g], minlength=n**3)
    grids = grids.reshape(4, n, n, n)
    return grids[0], [grids[1], grids[2], grids[3]]


def _smooth(field: np.ndarray, scale_cells: float) -> np.ndarray:
    if scale_cells <= 0:
        return field
    n = field.shape[0]
    kx, ky, kz = _wavevectors(n, 1.0)
    kernel = np.exp(-(kx**2 + ky**2 + kz**2) * scale_cells**2 / 2)
    return np.fft.irfftn(np.fft.rfftn(field) * kernel, s=field.shape, axes=(0, 1, 2))


def expected_velocity_rms(spec) -> float:
    """Expected rms of one linear velocity component (units of a H Mpc/h): f^2 / 3 integral P dk / (2 pi^2)."""
    k = np.logspace(-4, math.log10(math.pi / spec.cell_mpc_h), 4000)
    return growth_rate(spec) * math.sqrt(np.trapezoid(linear_power(k, spec), k) / (6 * np.pi**2))


def generate_lcdm_box(spec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One box: (Nbody (4, n, n, n), Hydro (5, n, n, n)), float32, normalized. Deterministic in (spec, n, seed)."""
    shape = (n, n, n)
    cell = spec.cell_mpc_h
    delta_k = linear_density_k(spec, n, seed)
    kx, ky, kz = _wavevectors(n, cell)
    k2 = kx**2 + ky**2 + kz**2
    inv_k2 = np.divide(1.0, k2, out=np.zeros_like(k2), where=k2 > 0)
    psi = np.stack([np.fft.irfftn(1j * kc * inv_k2 * delta_k, s=shape, axes=(0, 1, 2)) for kc in (kx, ky, kz)])
    del delta_k
    rho, momentum = _deposit(psi, cell, growth_rate(spec))  # rho has mean 1: one particle per cell
    del psi
    v_dm = [np.divide(p, rho, out=np.zeros_like(p), where=rho > 0) for p in momentum]

    jeans = spec.jeans_mpc_h / cell
    rho_gas = np.maximum(_smooth(rho, jeans), _DENSITY_FLOOR)
    v_gas = [_smooth(p, jeans) / rho_gas for p in momentum]
    divergence = sum(
        np.fft.irfftn(1j * kc * np.fft.rfftn(v), s=shape, axes=(0, 1, 2))
        for kc, v in zip((kx, ky, kz), v_gas, strict=True)
    )
    scatter = np.random.default_rng(seed + 2**31).standard_normal(shape) * spec.temperature_scatter_dex
    # Shock heating grows continuously from the density threshold and with the rate of compression, so that the hot
    # phase is a function of the gas's state (which a network can learn), not a step at a threshold.
    compression = np.maximum(-divergence / divergence.std(), 0.0)
    heating = (spec.T_shock / spec.T0) * np.maximum(rho_gas / spec.shock_density - 1, 0.0) * compression
    temperature = spec.T0 * rho_gas ** (spec.gamma - 1) * 10**scatter * (1 + heating)

    v_unit = spec.velocity_unit_sigmas * expected_velocity_rms(spec)
    log_density = np.log(np.maximum(rho, _DENSITY_FLOOR)) / LOG_DENSITY_SCALE
    nbody = np.stack([log_density, *(v / v_unit for v in v_dm)])
    hydro = np.stack(
        [
            np.log(rho_gas) / LOG_DENSITY_SCALE,
            *(v / v_unit for v in v_gas),
            np.log10(temperature / spec.T0) / spec.temperature_log_range,
        ]
    )
    return nbody.astype(np.float32), hydro.astype(np.float32)
