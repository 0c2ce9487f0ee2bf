"""The errors of the trainer and its commands. Bad input (``USER_ERRORS``) is one error line and exit status 2 in
every command; a run that diverged (``NumericalError``) exits with status 3."""

from pipeline.volumes import DataError


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded; the message says which and why."""


class DistError(ValueError):
    """Contradictory or incomplete distributed settings; the message names the variables."""


class HostfileError(ValueError):
    """A hostfile the launcher would misread; the message names the file and line."""


class NumericalError(RuntimeError):
    """Training produced numbers it cannot continue from (NaN or Inf losses, NaN weights)."""


# Bad input: config, data, environment, checkpoint, hostfile.
USER_ERRORS = (ConfigError, DataError, DistError, CheckpointError, HostfileError)
