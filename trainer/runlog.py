"""What a run leaves behind: one record per log point, to metrics.jsonl and TensorBoard alike."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from common.files import write_text_atomically
from trainer.rundir import ABANDONED_METRICS, METRICS, TENSORBOARD


class RunLog:
    """Rank 0 writes; on other ranks every call is a no-op, so callers need not ask who they are.

    A record is ``step`` plus named scalars (``loss/train``, ``lr``...): the same names are the
    TensorBoard tags and the metrics.jsonl keys. ``epoch``, ``samples`` and the per-rank losses are
    kept in the JSON only.
    """

    _JSON_ONLY = ("epoch", "samples", "loss/train_per_rank")

    def __init__(self, run_dir: Path, *, enabled: bool, resumed_step: int | None = None) -> None:
        """``resumed_step``: the step a resumed run continues from. What an earlier run logged beyond it (steps done
        again now, after a stop between checkpoints or from an older checkpoint than the newest) leaves
        metrics.jsonl for metrics.abandoned.jsonl, and TensorBoard drops it (its purge step)."""
        self.enabled = enabled
        self._start = time.time()
        if enabled:
            path = run_dir / METRICS
            if resumed_step is not None and path.is_file():
                _set_aside_beyond(path, run_dir / ABANDONED_METRICS, resumed_step)
            self._jsonl = path.open("a")
            purge = None if resumed_step is None else resumed_step + 1
            self._tb = SummaryWriter(log_dir=str(run_dir / TENSORBOARD), purge_step=purge)

    def write(self, step: int, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time_s": round(time.time() - self._start, 3), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for tag, value in values.items():
            if tag not in self._JSON_ONLY and value is not None and math.isfinite(value):
                self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


def _set_aside_beyond(path: Path, aside: Path, step: int) -> None:
    """Move the records of ``path`` beyond ``step``, and any line that is not a record (one cut short by a crash),
    to the end of ``aside``; ``path`` is replaced atomically, ending in a whole line."""
    text = path.read_text()
    kept, beyond = [], []
    for line in text.splitlines():
        try:
            later = json.loads(line)["step"] > step
        except (ValueError, KeyError, TypeError):
            later = True
        (beyond if later else kept).append(line)
    if beyond or (text and not text.endswith("\n")):
        if beyond:
            with aside.open("a") as f:
                f.write("".join(line + "\n" for line in beyond))
                f.flush()
                os.fsync(f.fileno())
        write_text_atomically(path, "".join(line + "\n" for line in kept))
