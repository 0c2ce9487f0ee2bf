"""Stopping on request: a signal asks for a checkpoint at the next step boundary and a clean exit.

Slurm sends SIGTERM when it preempts or cancels a job, and a chosen signal before the time limit
when asked (``sbatch --signal=USR1@300``). The handler only records the request; the training loop
acts on it at an optimizer-step boundary, once every rank has agreed to stop (ranks may receive
the signal at different moments), saves a checkpoint and exits with ``PREEMPTED_EXIT``.
"""

from __future__ import annotations

import signal
from types import FrameType

# EX_TEMPFAIL: stopped on request after a checkpoint; `--resume` continues. slurm/train.sbatch requeues on it.
PREEMPTED_EXIT = 75


class StopRequest:
    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        self.signal_name: str | None = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name  # only a flag: the loop logs and acts on it

    @property
    def requested(self) -> bool:
        return self.signal_name is not None
