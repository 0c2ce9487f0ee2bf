"""Training the emulator through a DeepSpeed engine: config, distributed setup, schedule and loop."""

import os

# DeepSpeed picks its accelerator when it is first imported, and where it finds no GPU it says so in every process
# ("Setting accelerator to CPU ... we were unable to detect it"). Naming the CPU before DeepSpeed is imported, where
# there is no NVIDIA driver, keeps that quiet (without importing torch here); a DS_ACCELERATOR from the environment
# still wins, and with a GPU DeepSpeed finds it by itself.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
