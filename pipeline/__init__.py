"""Data for the emulator: synthetic cosmology boxes, volume readers and DALI pipelines."""
