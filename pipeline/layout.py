"""The data layout shared by every reader and writer: the reference's HDF5 files.

Each file holds two float32 datasets over a periodic box of side L voxels:
``Nbody`` (4, L, L, L) and ``Hydro`` (5, L, L, L), channels first, spatial axes (x, y, z) in
array order, so that velocity component ``vx`` points along array axis 1.
"""

from typing import Any

import numpy as np

NBODY_DATASET = "Nbody"
HYDRO_DATASET = "Hydro"
NBODY_CHANNELS = ("dm_density", "vx", "vy", "vz")
HYDRO_CHANNELS = ("gas_density", "vx", "vy", "vz", "temperature")

# Where the gas density and the temperature are among the targets.
GAS_DENSITY = HYDRO_CHANNELS.index("gas_density")
TEMPERATURE = HYDRO_CHANNELS.index("temperature")

# Density channels hold log(rho) / 14, the reference's normalization; the loss's lambda_rho term and the science
# metrics undo it to compare densities in original space.
LOG_DENSITY_SCALE = 14.0


def density(x: Any) -> Any:
    """rho from a density channel (log(rho) / 14), in the precision of ``x`` (a numpy array or a torch tensor)."""
    scaled = x * LOG_DENSITY_SCALE
    return scaled.exp() if hasattr(scaled, "exp") else np.exp(scaled)


def temperature(x: Any, log_range: float) -> Any:
    """T / T0 from a temperature channel normalized as log10(T / T0) / ``log_range`` (numpy array or tensor)."""
    return 10.0 ** (x * log_range)
