"""What a run leaves behind: one record per log point, to metrics.jsonl and TensorBoard alike."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter


class RunLog:
    """Rank 0 writes; on other ranks every call is a no-op, so callers need not ask who they are.

    A record is ``step`` plus named scalars (``loss/train``, ``lr``...): the same names are the
    TensorBoard tags and the metrics.jsonl keys. ``epoch``, ``samples`` and the per-rank losses are
    kept in the JSON only.
    """

    _JSON_ONLY = ("epoch", "samples", "loss/train_per_rank")

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self._start = time.time()
        if enabled:
            self._jsonl = (run_dir / "metrics.jsonl").open("a")
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

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
