"""Training the emulator through a DeepSpeed engine: config, distributed setup, schedule and loop."""
