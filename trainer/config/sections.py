"""The parts of the config that each component reads, as typed views of the flat keys (the YAML files and the
command line keep the reference's flat keys): a component takes its section, so that what it reads is in view."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def section(cls: type[T], cfg: Any, prefix: str = "") -> T:
    """The ``cls`` view of ``cfg``: each of its fields from the flat key ``prefix + name``."""
    return cls(**{f.name: getattr(cfg, prefix + f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """``checkpoint_*``: when a run saves and how many checkpoints it keeps."""

    keep: int
    every_epochs: int
    every_steps: int | None
    every_minutes: float | None


@dataclass(frozen=True, kw_only=True)
class Faults:
    """What the step guard checks: non-finite losses and data, and when to stop for them."""

    nonfinite_loss: str
    max_nonfinite_in_a_row: int
    data_checks: str


@dataclass(frozen=True, kw_only=True)
class Science:
    """``science_*``: the science metrics of the validation box during training."""

    every_epochs: int
    box_size: int | None


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """What the loaders draw: crops of ``data_size``, rotated or not, the channels and their vectors, the seed, and the
    validation samples."""

    seed: int
    accumulate_as_ranks: bool
    data_size: int
    rotate: bool
    N_in_channels: int
    N_out_channels: int
    input_vectors: list[list[int]]
    target_vectors: list[list[int]]
    Nsamples_val: int
    last_batch: str
