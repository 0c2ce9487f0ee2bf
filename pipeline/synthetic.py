"""Synthetic cosmology boxes in the reference layout, so that everything runs without the 40 GB dataset.

    python -m pipeline.synthetic --out_dir data/synthetic --train_box_size 128 --val_box_size 64

The inputs are a Gaussian random field made log-normal and its linear-theory velocities; the targets are local but
non-trivial functions of them (smoothed gas, a temperature-density relation with shock heating), normalized as the
reference normalizes, by the spectrum and not the realization: docs/data.md (Synthetic boxes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from common.cli import ArgumentParser, output_dir
from common.files import written_atomically
from common.outputs import OutputError, claim_files
from pipeline.layout import HYDRO_CHANNELS, HYDRO_DATASET, LOG_DENSITY_SCALE, NBODY_CHANNELS, NBODY_DATASET
from pipeline.volumes import DataError, read_hdf5


def _param(default: float, help: str) -> Any:
    return field(default=default, metadata={"help": help})


# The settings only one universe reads (with "universe" itself, left out of a toy box's description).
_LCDM_ONLY = ("universe", "omega_m", "omega_b", "h", "n_s", "sigma8", "redshift", "cell_mpc_h", "jeans_mpc_h", "T0")
_LCDM_ONLY += ("temperature_scatter_dex", "shock_density", "T_shock", "lpt_order")
_TOY_ONLY = ("k_peak", "k_cut", "sigma_log_density", "gas_smoothing", "shock_heating")


@dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
    """How to generate a train and a validation box. Lengths are in voxels, wavenumbers in radians per voxel."""

    train_box_size: int = _param(128, "side of the training box in voxels")
    val_box_size: int = _param(64, "side of the validation box (the reference's is half the training one)")
    seed: int = _param(0, "seed of the training box; the validation box uses seed + 1")
    k_peak: float = _param(0.3, "where the spectrum turns from P ~ k (large scales) to P ~ k^-3 (small scales)")
    k_cut: float = _param(1.2, "Gaussian cut-off of the spectrum, below the Nyquist wavenumber pi")
    sigma_log_density: float = _param(1.6, "rms of the Gaussian field behind log(dark-matter density)")
    gas_smoothing: float = _param(1.5, "Gaussian smoothing radius of the gas relative to the dark matter")
    gamma: float = _param(1.6, "slope of the temperature-density relation T = T0 rho^(gamma - 1)")
    shock_heating: float = _param(1.0, "heating in converging flows: T *= 1 + shock_heating relu(-div v / rms)^2")
    velocity_unit_sigmas: float = _param(4.0, "velocities are divided by this many expected rms of one component")
    temperature_log_range: float = _param(3.0, "normalized temperature is log10(T / T0) divided by this")
    universe: str = _param(
        "toy", "toy: the Gaussian-field boxes above; lcdm: LCDM initial conditions moved by 2LPT (pipeline.lcdm)"
    )
    # The lcdm universe (the toy one ignores these): a flat LCDM cosmology, Planck 2015's by default.
    omega_m: float = _param(0.3089, "lcdm: matter density Omega_m")
    omega_b: float = _param(0.0486, "lcdm: baryon density Omega_b")
    h: float = _param(0.6774, "lcdm: Hubble constant / (100 km/s/Mpc)")
    n_s: float = _param(0.9667, "lcdm: spectral index")
    sigma8: float = _param(0.8159, "lcdm: rms linear density in spheres of 8 Mpc/h at z = 0")
    redshift: float = _param(3.0, "lcdm: redshift of the boxes (the reference's Lyman-alpha forest era)")
    cell_mpc_h: float = _param(1.0, "lcdm: side of a voxel in Mpc/h")
    jeans_mpc_h: float = _param(1.5, "lcdm: Gaussian pressure-smoothing scale of the gas, in Mpc/h")
    T0: float = _param(1e4, "lcdm: temperature at mean gas density, in K")
    temperature_scatter_dex: float = _param(0.03, "lcdm: log-normal scatter around T0 rho^(gamma - 1), in dex")
    shock_density: float = _param(1.5, "lcdm: gas density above which converging gas is shock-heated")
    T_shock: float = _param(
        1e5,
        "lcdm: shock heating multiplies T by 1 + (T_shock / T0) (rho / shock_density - 1) c, c the compression -div v "
        "over its expected linear rms",
    )
    lpt_order: int = _param(2, "lcdm: Lagrangian perturbation theory of the displacement: 1 (Zel'dovich) or 2 (2LPT)")

    def problem(self) -> str | None:
        """What makes this spec unusable, in words; None when it is fine."""
        if min(self.train_box_size, self.val_box_size) < 2:
            return f"box sizes must be at least 2, got {self.train_box_size} and {self.val_box_size}"
        if self.seed < 0:
            return f"seed must not be negative, got {self.seed}"
        if not math.isfinite(self.gamma):
            return f"gamma must be finite, got {self.gamma}"
        if self.universe not in ("toy", "lcdm"):
            return f"universe must be toy or lcdm, got {self.universe!r}"
        if self.lpt_order not in (1, 2):
            return f"lpt_order must be 1 or 2, got {self.lpt_order}"
        # sigma_log_density 0 would make a uniform box, whose velocities are 0/0
        positive = ("k_peak", "k_cut", "sigma_log_density", "velocity_unit_sigmas", "temperature_log_range")
        positive += ("omega_m", "omega_b", "h", "n_s", "sigma8", "cell_mpc_h", "T0", "shock_density", "T_shock")
        not_negative = ("gas_smoothing", "shock_heating", "redshift", "jeans_mpc_h", "temperature_scatter_dex")
        for name in positive + not_negative:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name in positive):
                return f"{name} must be {'positive' if name in positive else 'non-negative'}, got {value}"
        if self.omega_b >= self.omega_m:
            return f"omega_b ({self.omega_b}) must be smaller than omega_m ({self.omega_m})"
        # A setting of the other universe would be ignored silently: say so instead.
        ignored = _TOY_ONLY if self.universe == "lcdm" else _LCDM_ONLY
        defaults = SyntheticSpec()
        changed = [name for name in ignored if name != "universe" and getattr(self, name) != getattr(defaults, name)]
        if changed:
            return f"{', '.join(changed)} set, but universe {self.universe} does not use them"
        return None


def _spectrum_shape(k: np.ndarray, spec: SyntheticSpec) -> np.ndarray:
    return k / (1.0 + (k / spec.k_peak) ** 2) ** 2 * np.exp(-((k / spec.k_cut) ** 2))


def _expected_moments(spec: SyntheticSpec) -> tuple[float, float]:
    """Expected variance of the unnormalized density field and of one velocity component.

    On a grid, var(delta) = mean over modes of P(k) = 1/(2 pi^2) integral k^2 P(k) dk, independent of
    the box size up to the missing large-scale modes; velocity per component: 1/(6 pi^2) integral P dk.
    """
    k = np.linspace(0.0, np.pi, 20001)
    p = _spectrum_shape(k, spec)
    var_delta = np.trapezoid(k**2 * p, k) / (2 * np.pi**2)
    var_v = np.trapezoid(p, k) / (6 * np.pi**2)
    return float(var_delta), float(var_v)


def _wavevectors(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    kx = 2 * np.pi * np.fft.fftfreq(n)[:, None, None]
    ky = 2 * np.pi * np.fft.fftfreq(n)[None, :, None]
    kz = 2 * np.pi * np.fft.rfftfreq(n)[None, None, :]
    return kx, ky, kz


def generate_box(spec: SyntheticSpec, box_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One box: (Nbody (4, L, L, L), Hydro (5, L, L, L)), float32, normalized. Deterministic in (spec, L, seed)."""
    if spec.universe == "lcdm":
        from pipeline.lcdm import generate_lcdm_box

        return generate_lcdm_box(spec, box_size, seed)
    n = box_size
    shape = (n, n, n)
    rng = np.random.default_rng(seed)
    kx, ky, kz = _wavevectors(n)
    k2 = kx**2 + ky**2 + kz**2
    inv_k2 = np.divide(1.0, k2, out=np.zeros_like(k2), where=k2 > 0)  # the mean mode carries no velocity
    var_delta, var_v = _expected_moments(spec)
    amplitude = spec.sigma_log_density / np.sqrt(var_delta)

    # Gaussian field with the target spectrum: filter white noise in Fourier space.
    delta_k = np.fft.rfftn(rng.standard_normal(shape)) * (amplitude * np.sqrt(_spectrum_shape(np.sqrt(k2), spec)))
    delta = np.fft.irfftn(delta_k, s=shape, axes=(0, 1, 2))

    # Linear theory: v_k = i k / k^2 delta_k.
    v_unit = spec.velocity_unit_sigmas * amplitude * np.sqrt(var_v)
    v_k = [1j * kc * inv_k2 * delta_k for kc in (kx, ky, kz)]
    v_dm = [np.fft.irfftn(vk, s=shape, axes=(0, 1, 2)) for vk in v_k]

    # Log-normal dark matter with mean density 1.
    rho_dm = np.exp(delta - spec.sigma_log_density**2 / 2)

    # Gas: smoothed over the pressure scale.
    smooth = np.exp(-0.5 * k2 * spec.gas_smoothing**2)
    rho_gas = np.fft.irfftn(np.fft.rfftn(rho_dm) * smooth, s=shape, axes=(0, 1, 2))
    rho_gas = np.maximum(rho_gas, 1e-6)  # a Gaussian filter keeps density positive, up to round-off
    v_gas_k = [vk * smooth for vk in v_k]
    v_gas = [np.fft.irfftn(vk, s=shape, axes=(0, 1, 2)) for vk in v_gas_k]
    divergence = np.fft.irfftn(
        sum(1j * kc * vk for kc, vk in zip((kx, ky, kz), v_gas_k, strict=True)), s=shape, axes=(0, 1, 2)
    )
    compression = np.maximum(-divergence / divergence.std(), 0.0)
    log10_t_over_t0 = (spec.gamma - 1) * np.log10(rho_gas) + np.log10(1 + spec.shock_heating * compression**2)

    nbody = np.stack([np.log(rho_dm) / LOG_DENSITY_SCALE, *(v / v_unit for v in v_dm)])
    hydro = np.stack(
        [
            np.log(rho_gas) / LOG_DENSITY_SCALE,
            *(v / v_unit for v in v_gas),
            log10_t_over_t0 / spec.temperature_log_range,
        ]
    )
    return nbody.astype(np.float32), hydro.astype(np.float32)


def _attributes(spec: SyntheticSpec, box_size: int, seed: int) -> dict[str, str | int]:
    described = dataclasses.asdict(spec)
    if spec.universe == "toy":  # toy boxes are described as before the lcdm universe existed: they stay valid
        described = {k: v for k, v in described.items() if k not in _LCDM_ONLY}
    return {
        "generator": "pipeline.synthetic",
        "spec": json.dumps(described, sort_keys=True),
        "box_size": box_size,
        "seed": seed,
        "normalization": json.dumps(
            {
                "density": f"log(rho) / {LOG_DENSITY_SCALE:g}",
                "velocity": f"v / ({spec.velocity_unit_sigmas:g} x expected rms of one component)",
                "temperature": f"log10(T / T0) / {spec.temperature_log_range:g}",
            }
        ),
    }


def write_box(path: Path, spec: SyntheticSpec, box_size: int, *, seed: int) -> None:
    """Generate one box and write it to ``path`` atomically (a reader never sees a partial file)."""
    nbody, hydro = generate_box(spec, box_size, seed)
    with written_atomically(path) as tmp, h5py.File(tmp, "w") as f:
        for key, value in _attributes(spec, box_size, seed).items():
            f.attrs[key] = value
        for name, data, channels in ((NBODY_DATASET, nbody, NBODY_CHANNELS), (HYDRO_DATASET, hydro, HYDRO_CHANNELS)):
            f.create_dataset(name, data=data).attrs["channels"] = json.dumps(channels)


def boxes(spec: SyntheticSpec) -> dict[str, tuple[int, int]]:
    """(box size, seed) of the train and validation boxes."""
    return {"train": (spec.train_box_size, spec.seed), "val": (spec.val_box_size, spec.seed + 1)}


def ensure_box(path: Path, spec: SyntheticSpec, which: str) -> bool:
    """Write the ``which`` ('train' or 'val') box to ``path`` unless it is there already; True if written.

    An existing file must have been generated from the same spec: anything else is an error, since
    silently training on other data than the config says would be worse.
    """
    box_size, seed = boxes(spec)[which]
    if path.exists():
        try:
            with read_hdf5(path) as f:
                found = {key: f.attrs.get(key) for key in ("generator", "spec", "box_size", "seed")}
        except OSError as err:
            raise DataError(f"{path}: not a readable HDF5 file ({err}); delete it to have it generated again") from None
        wanted = _attributes(spec, box_size, seed)
        if any(found[key] != wanted[key] for key in found):
            raise DataError(
                f"{path} exists but was not generated from this config's synthetic spec; "
                "delete it or point the config elsewhere"
            )
        return False
    write_box(path, spec, box_size, seed=seed)
    return True


def ensure_boxes(spec: SyntheticSpec, train_path: str | Path, val_path: str | Path) -> list[tuple[str, Path]]:
    """``ensure_box`` for the training and the validation box; the (which, path) of those it wrote."""
    paths = {"train": Path(train_path), "val": Path(val_path)}
    return [(which, path) for which, path in paths.items() if ensure_box(path, spec, which)]


def _is_synthetic_box(path: Path) -> bool:
    """Whether ``path`` is a box this module wrote: an HDF5 file that names it as its generator."""
    try:
        with read_hdf5(path) as f:
            return f.attrs.get("generator") == "pipeline.synthetic"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m pipeline.synthetic", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out_dir", type=output_dir, default=Path("data/synthetic"), help="writes train.h5 and val.h5 here"
    )
    for f in dataclasses.fields(SyntheticSpec):
        parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default, help=f.metadata["help"])
    parser.add_argument("--overwrite", action="store_true", help="write boxes this project wrote there before again")
    args = parser.parse_args(argv)
    spec = SyntheticSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SyntheticSpec)})
    if problem := spec.problem():
        parser.error(problem)
    for which, (box_size, seed) in boxes(spec).items():
        start = time.perf_counter()
        path = args.out_dir / f"{which}.h5"
        if path.exists() and not args.overwrite and _is_synthetic_box(path):
            print(f"{path} exists: kept (--overwrite writes it again)")
            continue
        try:
            claim_files(
                [path],
                by="pipeline.synthetic",
                overwrite=True,
                legacy=_is_synthetic_box,
                advice="choose another --out_dir",
            )
        except OutputError as err:
            parser.error(str(err))
        write_box(path, spec, box_size, seed=seed)
        print(f"wrote {path}: {box_size}^3, seed {seed}, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
