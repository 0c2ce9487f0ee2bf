"""A synthetic universe from a cosmology: LCDM initial conditions, dark matter moved by Lagrangian perturbation
theory (2LPT, or Zel'dovich alone), and gas that follows it down to a pressure-smoothing scale.

The steps (the linear spectrum, the Gaussian field and its displacements, the particles deposited cell by cell, the
gas's smoothing, temperature and shock heating) and the normalization are in docs/data.md (Synthetic boxes).
Everything is float32 and released as soon as used.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from pipeline.layout import LOG_DENSITY_SCALE

_DENSITY_FLOOR = 1e-3  # cells no particle reaches (deep voids) get this density, not log(0)


@functools.cache
def _cosmology(omega_m: float, omega_b: float, h: float, *, n_s: float, sigma8: float):
    from colossus.cosmology import cosmology  # imported here: only the lcdm universe needs it

    params = {"flat": True, "H0": 100 * h, "Om0": omega_m, "Ob0": omega_b, "sigma8": sigma8, "ns": n_s}
    return cosmology.setCosmology("synthetic", params=params, persistence="")


def linear_power(k_h_mpc: np.ndarray, spec) -> np.ndarray:
    """Linear P(k) in (Mpc/h)^3 at the spec's redshift, for k in h/Mpc (0 where k is 0)."""
    cosmo = _cosmology(spec.omega_m, spec.omega_b, spec.h, n_s=spec.n_s, sigma8=spec.sigma8)
    k = np.asarray(k_h_mpc, dtype=np.float64)
    out = np.zeros_like(k)
    positive = k > 0
    growth = cosmo.growthFactor(spec.redshift)
    out[positive] = cosmo.matterPowerSpectrum(k[positive], 0.0) * growth**2
    return out


def _omega_m_at(spec) -> float:
    a3 = (1 + spec.redshift) ** 3
    return spec.omega_m * a3 / (spec.omega_m * a3 + 1 - spec.omega_m)


def growth_rate(spec) -> float:
    """f = dln D / dln a, by the usual Omega_m(z)^0.55."""
    return _omega_m_at(spec) ** 0.55


def _wavevectors(n: int, cell: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Wavevectors of the rfft grid in h/Mpc, float32 (the grids are float32: a 512^3 box fits in 24 GB)."""
    k1 = (2 * np.pi * np.fft.fftfreq(n, d=cell)).astype(np.float32)
    kz = (2 * np.pi * np.fft.rfftfreq(n, d=cell)).astype(np.float32)
    return k1[:, None, None], k1[None, :, None], kz[None, None, :]


def _k_squared(n: int, cell: float) -> np.ndarray:
    kx, ky, kz = _wavevectors(n, cell)
    return kx**2 + ky**2 + kz**2


def _inverse(k2: np.ndarray) -> np.ndarray:
    return np.divide(1.0, k2, out=np.zeros_like(k2), where=k2 > 0)


def _real(field_k: np.ndarray, n: int) -> np.ndarray:
    return np.fft.irfftn(field_k, s=(n, n, n), axes=(0, 1, 2))


def linear_density_k(spec, n: int, seed: int) -> np.ndarray:
    """Fourier modes (rfftn layout, complex64) of the linear density contrast on the n^3 grid, at the spec's
    redshift."""
    cell = spec.cell_mpc_h
    volume = (n * cell) ** 3
    noise = np.fft.rfftn(np.random.default_rng(seed).standard_normal((n, n, n), dtype=np.float32))
    # White noise of unit variance per cell has |W_k|^2 = n^3 on average: scale to <|delta_k|^2> = P(k) n^6 / V.
    k = np.sqrt(_k_squared(n, cell))
    for plane in range(n):  # plane by plane: the float64 spectrum of the whole grid would be twice its size
        noise[plane] *= np.sqrt(linear_power(k[plane], spec) * n**3 / volume).astype(np.float32)
    return noise


def _second_order_source_k(delta_k: np.ndarray, n: int, cell: float) -> np.ndarray:
    """Fourier modes of sum_{i>j} (phi_ii phi_jj - phi_ij^2), phi the potential with laplacian delta, computed
    with three of its six second derivatives in memory at a time."""
    kx, ky, kz = _wavevectors(n, cell)
    k = (kx, ky, kz)
    scaled = delta_k * _inverse(_k_squared(n, cell))  # phi_ij = irfft(k_i k_j delta_k / k^2)
    diagonal = [_real(scaled * (k[i] * k[i]), n) for i in range(3)]
    source = diagonal[0] * diagonal[1] + diagonal[0] * diagonal[2] + diagonal[1] * diagonal[2]
    del diagonal
    for i, j in ((0, 1), (0, 2), (1, 2)):
        source -= _real(scaled * (k[i] * k[j]), n) ** 2
    return np.fft.rfftn(source)


def displacement(spec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Lagrangian displacement psi (3, n, n, n) in Mpc/h of the particle at each cell, and the velocity v
    (3, n, n, n) in units of a H Mpc/h, both float32: Zel'dovich (psi1 = i k / k^2 delta_k), plus with
    ``lpt_order`` 2 the second-order term psi2 = -3/7 grad laplacian^-1 of the source above (D2 = -3/7 D1^2), whose
    growth rate is f2 = 2 Omega_m(z)^(6/11)."""
    cell = spec.cell_mpc_h
    delta_k = linear_density_k(spec, n, seed)
    k = _wavevectors(n, cell)
    inv_k2 = _inverse(_k_squared(n, cell))
    second_k = _second_order_source_k(delta_k, n, cell) * inv_k2 if spec.lpt_order == 2 else None
    f1, f2 = growth_rate(spec), 2 * _omega_m_at(spec) ** (6 / 11)
    psi = np.empty((3, n, n, n), dtype=np.float32)
    velocity = np.empty_like(psi)
    for axis in range(3):
        psi[axis] = _real(1j * k[axis] * inv_k2 * delta_k, n)
        velocity[axis] = f1 * psi[axis]
        if second_k is not None:
            psi2 = _real((-3 / 7) * -1j * k[axis] * second_k, n)
            psi[axis] += psi2
            velocity[axis] += f2 * psi2
    return psi, velocity


_SLAB = 16  # planes of particles deposited at a time: bounds the deposit's memory to a few n^2 x 16 arrays


def _deposit(psi: np.ndarray, velocity: np.ndarray, cell: float) -> np.ndarray:
    """Cloud-in-cell deposit of one particle per cell, moved from its cell q to q + psi(q) (periodic): the density
    rho / rho_mean and the three momentum components (4, n, n, n), float32. Particles go slab by slab of ``_SLAB``
    planes into a window of the planes they reach, so that memory stays the four grids and a few slabs."""
    n = psi.shape[1]
    grids = np.zeros((4, n, n, n), dtype=np.float32)  # mass, then momentum along x, y, z
    plane = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij")).reshape(2, -1)
    for start in range(0, n, _SLAB):
        planes = np.arange(start, min(start + _SLAB, n))
        q = np.concatenate([np.repeat(planes, n * n)[None], np.tile(plane, len(planes))]).astype(np.float64)
        position = q + psi[:, planes].reshape(3, -1) / cell
        values = np.concatenate([np.ones((1, position.shape[1])), velocity[:, planes].reshape(3, -1)])
        base = np.floor(position)
        frac = position - base
        base = base.astype(np.int64)
        lo = int(base[0].min())
        width = int(base[0].max()) + 2 - lo  # the x planes this slab's particles reach, unwrapped
        window = np.zeros((4, width * n * n))
        for corner in range(8):
            offset = np.array([(corner >> 2) & 1, (corner >> 1) & 1, corner & 1])[:, None]
            w = np.prod(np.where(offset, frac, 1 - frac), axis=0)
            idx = base + offset
            flat = ((idx[0] - lo) * n + idx[1] % n) * n + idx[2] % n
            for g in range(4):
                window[g] += np.bincount(flat, weights=w * values[g], minlength=width * n * n)
        window = window.reshape(4, width, n, n)
        for i in range(width):  # planes wrap around the box
            grids[:, (lo + i) % n] += window[:, i]
    return grids


def _smooth(field: np.ndarray, scale_cells: float) -> np.ndarray:
    if scale_cells <= 0:
        return field
    kernel = np.exp(-_k_squared(field.shape[0], 1.0) * np.float32(scale_cells**2 / 2))
    return _real(np.fft.rfftn(field) * kernel, field.shape[0])


def _linear_integral(spec, weight) -> float:
    """integral P(k) weight(k) dk from 1e-4 h/Mpc to the grid's Nyquist wavenumber pi / cell."""
    k = np.logspace(-4, math.log10(math.pi / spec.cell_mpc_h), 4000)
    return float(np.trapezoid(linear_power(k, spec) * weight(k), k))


def expected_velocity_rms(spec) -> float:
    """Expected rms of one linear velocity component (units of a H Mpc/h): f^2 / 3 integral P dk / (2 pi^2)."""
    return growth_rate(spec) * math.sqrt(_linear_integral(spec, np.ones_like) / (6 * np.pi**2))


def expected_divergence_rms(spec) -> float:
    """Expected rms of the linear velocity divergence smoothed at the Jeans scale (units of a H): theta = -f delta,
    so f^2 integral P(k) exp(-k^2 lambda^2) k^2 dk / (2 pi^2), up to the grid's Nyquist wavenumber. The unit of the
    compression that heats the gas: a fixed number, so that a region's temperature does not depend on the box."""
    smoothed = _linear_integral(spec, lambda k: np.exp(-((k * spec.jeans_mpc_h) ** 2)) * k**2)
    return growth_rate(spec) * math.sqrt(smoothed / (2 * np.pi**2))


def generate_lcdm_box(spec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One box: (Nbody (4, n, n, n), Hydro (5, n, n, n)), float32, normalized. Deterministic in (spec, n, seed).
    Peak memory about 24 n^3 floats (13 GB at 512^3)."""
    cell = spec.cell_mpc_h
    psi, velocity = displacement(spec, n, seed)
    grids = _deposit(psi, velocity, cell)  # rho has mean 1: one particle per cell
    del psi, velocity
    rho, momentum = grids[0], grids[1:]
    v_unit = np.float32(spec.velocity_unit_sigmas * expected_velocity_rms(spec))
    nbody = np.empty((4, n, n, n), dtype=np.float32)
    nbody[0] = np.log(np.maximum(rho, _DENSITY_FLOOR)) / LOG_DENSITY_SCALE
    for axis in range(3):
        nbody[1 + axis] = np.divide(momentum[axis], rho * v_unit, out=np.zeros_like(rho), where=rho > 0)

    jeans = spec.jeans_mpc_h / cell
    hydro = np.empty((5, n, n, n), dtype=np.float32)
    rho_gas = np.maximum(_smooth(rho, jeans), _DENSITY_FLOOR)
    del grids, rho
    k = _wavevectors(n, cell)  # h/Mpc: the divergence in units of a H
    divergence_k = 0
    for axis in range(3):
        hydro[1 + axis] = _smooth(momentum[axis], jeans) / rho_gas
        divergence_k = divergence_k + 1j * k[axis] * np.fft.rfftn(hydro[1 + axis])
        hydro[1 + axis] /= v_unit
    del momentum
    hydro[0] = np.log(rho_gas) / LOG_DENSITY_SCALE
    compression = _real(divergence_k, n)
    del divergence_k
    compression = np.maximum(compression / np.float32(-expected_divergence_rms(spec)), 0.0)
    # Shock heating grows continuously from the density threshold and with the rate of compression, so that the hot
    # phase is a function of the gas's state (which a network can learn), not a step at a threshold.
    heating = np.maximum(rho_gas / np.float32(spec.shock_density) - 1, 0.0) * compression
    heating *= np.float32(spec.T_shock / spec.T0)
    del compression
    scatter = np.random.default_rng(seed + 2**31).standard_normal((n, n, n), dtype=np.float32)
    hydro[4] = (spec.gamma - 1) * np.log10(rho_gas) + spec.temperature_scatter_dex * scatter + np.log10(1 + heating)
    hydro[4] /= spec.temperature_log_range
    return nbody, hydro
