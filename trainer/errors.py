"""The errors of the trainer and its commands. Bad input (``USER_ERRORS``) is one error line and exit status 2 in
every command; a run that diverged (``NumericalError``) exits with status 3."""

import re

import torch

from common.hold import HeldError
from common.launch import DistError
from common.outputs import OutputError
from pipeline.volumes import DataError


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded; the message says which and why."""


class HostfileError(ValueError):
    """A hostfile the launcher would misread; the message names the file and line."""


class NumericalError(RuntimeError):
    """Training produced numbers it cannot continue from (NaN or Inf losses, NaN weights)."""


# Bad input: config, data, environment, checkpoint, hostfile, an output another process holds or the user wrote.
USER_ERRORS = (ConfigError, DataError, DistError, CheckpointError, HostfileError, HeldError, OutputError)


def out_of_memory(
    err: torch.OutOfMemoryError, micro_batch: int, crop: int, *, device: str, where: str, volumes: str | None = None
) -> ConfigError:
    """The one line for a micro-batch that does not fit: where, what was asked and what was free (from torch's
    message, which says it for CUDA), and what to lower; with ``volumes`` (their size, when they are resident on the
    device) storage first."""
    text = " ".join(str(err).split())
    asked = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
    free = re.search(r"total capacity of ([\d.]+ \w+) of which ([\d.]+ \w+) is free", text)
    memory = ", ".join(([f"{asked[1]} asked"] if asked else []) + ([f"{free[2]} free of {free[1]}"] if free else []))
    storage = f"set storage: host (the volumes take {volumes} of it), or " if volumes else ""
    return ConfigError(
        f"a micro-batch of {micro_batch} crops of {crop}^3 does not fit in the memory of {device} at {where}"
        f"{f' ({memory})' if memory else ''}: {storage}lower micro_batch_size (gradient accumulation keeps the global "
        "batch) or data_size"
    )
