"""Errors of a training run that are not bad input (those are ConfigError, DataError, DistError, CheckpointError)."""


class NumericalError(RuntimeError):
    """Training produced numbers it cannot continue from (NaN or Inf losses, NaN weights)."""
