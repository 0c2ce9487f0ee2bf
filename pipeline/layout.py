"""The data layout shared by every reader and writer: the reference's HDF5 files.

Each file holds two float32 datasets over a periodic box of side L voxels:
``Nbody`` (4, L, L, L) and ``Hydro`` (5, L, L, L), channels first, spatial axes (x, y, z) in
array order, so that velocity component ``vx`` points along array axis 1.
"""

NBODY_DATASET = "Nbody"
HYDRO_DATASET = "Hydro"
NBODY_CHANNELS = ("dm_density", "vx", "vy", "vz")
HYDRO_CHANNELS = ("gas_density", "vx", "vy", "vz", "temperature")

# Density channels hold log(rho) / 14, the reference's normalization; the loss's lambda_rho term
# undoes it to compare densities in original space.
LOG_DENSITY_SCALE = 14.0
