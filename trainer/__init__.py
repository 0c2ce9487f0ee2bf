"""Training the emulator through a DeepSpeed engine: config, distributed setup, schedule and loop."""

import os

import torch

# DeepSpeed picks its accelerator when it is first imported, and where it finds no GPU it says so in every process
# ("Setting accelerator to CPU ... we were unable to detect it"). Naming it before DeepSpeed is imported keeps that
# quiet; a DS_ACCELERATOR set in the environment still wins.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
