"""The run directory: the names of what a run leaves in it, where a new run goes, and the records written there.

A run holds its directory for its whole life (``common.hold``): another run that wants it is refused, naming the
holder. A new run never reuses a directory that holds an earlier run unless ``--overwrite`` says so; even then the
earlier run is only set aside (renamed into ``.overwritten``) and deleted once the new run has passed its
checks, or put back where it was if the new run stops before that. Files of the user's in it are refused unless
``--beside``, and never replaced (``common.outputs``); what killed runs left is reclaimed at the start. Records
(the resolved config, the summary) are replaced atomically.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist

from common.files import reclaim, temporaries, write_text_atomically
from common.hold import HeldError, Hold, hold_directory, holder_of
from common.outputs import OutputError, check_directory, mark, refuse_inputs
from model.checkpoints import CHECKPOINT_DIR, RUN_CONFIG, reclaim_temporaries
from model.slabs import earlier_prediction
from trainer.config import Config, to_dict
from trainer.dist import DistEnv
from trainer.errors import ConfigError
from trainer.provenance import git_commit

log = logging.getLogger(__name__)

CONFIG = RUN_CONFIG  # the resolved config: what --resume reads back
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
ABANDONED_METRICS = "metrics.abandoned.jsonl"  # what a resumed run logged again: the earlier run's beyond it
LOG = "train.log"
TENSORBOARD = "tensorboard"
PROFILE = "profile"
RUN_FILES = (CONFIG, METRICS, ABANDONED_METRICS, SUMMARY, LOG, TENSORBOARD, PROFILE, CHECKPOINT_DIR)
# --overwrite moves the earlier run here, and deletes it only once the new run has passed its checks.
SET_ASIDE = ".overwritten"
RUNS = Path("runs")
HELD = "wait for it to end, or choose another --run_dir"
COMMAND = "ds_train.py"  # what the run directory's mark says wrote its files


def _run_config(path: Path) -> bool:
    """Whether ``path`` is a run's resolved config (``RunDir.start`` writes it)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and isinstance(record.get("config"), dict) and "name" in record


def earlier_run(entry: Path) -> bool:
    """Whether an entry of a run directory from before marks existed is a run's: its files beside a run's resolved
    config, and a prediction directory of model.predict's default place."""
    if entry.name == "prediction" and entry.is_dir():
        return earlier_prediction(entry / "prediction.h5")
    return entry.name in RUN_FILES and _run_config(entry.parent / CONFIG)


def data_files(cfg: Config) -> list[Path]:
    """The files a run reads its data from: never among its outputs."""
    if cfg.data_format == "hdf5":
        names = [cfg.train_path, cfg.val_path]
    else:
        names = [cfg.train_path_npy_data, cfg.train_path_npy_label, cfg.val_path_npy_data, cfg.val_path_npy_label]
    return [Path(name) for name in names if name]


def refuse_leftover_set_aside(run_dir: Path) -> None:
    if (run_dir / SET_ASIDE).exists():
        raise ConfigError(
            f"{run_dir / SET_ASIDE} holds an earlier run that an interrupted --overwrite set aside: move its files "
            f"back into {run_dir} to keep that run, or delete it; then start again"
        )


def saved_config(run_dir: Path | None) -> dict[str, Any]:
    """What a run to be resumed recorded in its run directory: its name and config."""
    if run_dir is None:
        raise ConfigError("--resume needs --run_dir")
    holder = holder_of(run_dir) if (run_dir / SET_ASIDE).exists() else None
    if holder is not None:  # not left over: a run is starting there with --overwrite right now
        raise HeldError(f"{run_dir} is held by {holder.describe()}: {HELD}")
    refuse_leftover_set_aside(run_dir)
    path = run_dir / CONFIG
    if not path.is_file():
        raise ConfigError(f"--resume: {path} not found; is {run_dir} a run directory?")
    return json.loads(path.read_text())


def configure_logging(rank: int) -> None:
    """Log lines with a time stamp; INFO from rank 0, warnings and errors only from the others."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def new_run_path(name: str) -> Path:
    """A directory of its own for a run: ``runs/<name>-<date>-<time>``, with the Slurm job id where there is one,
    made here; ``-2``, ``-3``... added where another start took the name first."""
    job = os.environ.get("SLURM_JOB_ID")
    base = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}" + (f"-{job}" if job else "")
    RUNS.mkdir(parents=True, exist_ok=True)
    path, taken = RUNS / base, itertools.count(2)
    while True:
        try:
            path.mkdir()  # atomic, on shared file systems too: of two starts, one makes it
            return path
        except FileExistsError:
            path = RUNS / f"{base}-{next(taken)}"


class RunDir:
    """One run's directory, the same on every rank; rank 0 holds it for the run's life and writes into it."""

    def __init__(self, path: Path, dist: DistEnv, *, set_aside: bool, hold: Hold | None) -> None:
        self.path, self.dist, self.set_aside, self.hold = path, dist, set_aside, hold
        self.started = False

    @staticmethod
    def _hold(path: Path | None, name: str, dist: DistEnv) -> tuple[Path, Hold | None]:
        """Rank 0 holds the directory (a new one for ``path`` None); every rank learns where, or why not."""
        hold, outcome = None, [path, None]
        if dist.is_main:
            try:
                outcome[0] = path = path or new_run_path(name)
                hold = hold_directory(path, HELD)
            except (HeldError, OSError) as err:
                outcome[1] = err
        torch_dist.broadcast_object_list(outcome, src=0)
        if outcome[1] is not None:
            raise outcome[1]
        return outcome[0], hold

    @classmethod
    def claim(
        cls,
        path: Path | None,
        name: str,
        dist: DistEnv,
        *,
        resume: bool,
        overwrite: bool,
        beside: bool = False,
        inputs: list[Path] | None = None,
    ) -> RunDir:
        """The directory for this run (a new one by default), held by rank 0; an earlier run in it is set aside
        with ``overwrite``, continued with ``resume``, and otherwise a one-line error; so are files of the user's in
        it (``beside`` writes beside them) and ``inputs`` among its outputs."""
        path, hold = cls._hold(path, name, dist)
        try:
            adopted = cls._check(path, beside=beside, inputs=inputs or [])
            torch_dist.barrier()  # every rank has looked before rank 0 marks the run's names, before it writes any
            if dist.is_main:
                mark(path, [*adopted, *RUN_FILES], by=COMMAND)  # once for good: a run's names are its directory's
            run = cls._claim(path, hold, dist, resume=resume, overwrite=overwrite)
            run._reclaim()
            return run
        except BaseException:
            if hold is not None:
                hold.release()
            raise

    @staticmethod
    def _check(path: Path, *, beside: bool, inputs: list[Path]) -> list[str]:
        """On every rank: no file of the user's among the run's names (nor, without ``beside``, any) and no input
        among its outputs. The entries of a run from before marks existed, to mark."""
        refuse_leftover_set_aside(path)
        try:
            refuse_inputs([path / entry for entry in RUN_FILES], inputs)
            advice = "choose another --run_dir"
            return check_directory(path, RUN_FILES, beside=beside, legacy=earlier_run, advice=advice)
        except OutputError as err:
            raise ConfigError(str(err)) from None

    def _reclaim(self) -> None:
        """Rank 0: what killed runs left (temporaries of its records, of its checkpoints) reclaimed, in a line each;
        no live process writes there (the hold)."""
        if not self.dist.is_main:
            return
        found = temporaries(self.path, RUN_FILES)
        for line in filter(None, [reclaim(found, what="what killed runs left"), *reclaim_temporaries(self.path)]):
            log.warning("%s", line)

    @classmethod
    def _claim(cls, path: Path, hold: Hold | None, dist: DistEnv, *, resume: bool, overwrite: bool) -> RunDir:
        earlier = [entry for entry in RUN_FILES if (path / entry).exists()]
        set_aside = bool(earlier) and not resume
        if set_aside:
            if not overwrite:
                raise ConfigError(
                    f"{path} holds an earlier run ({', '.join(earlier)}): --resume continues it, "
                    "--overwrite deletes it, or choose another --run_dir"
                )
            torch_dist.barrier()  # every rank has looked before rank 0 moves anything
            if dist.is_main:
                (path / SET_ASIDE).mkdir()
                for entry in earlier:  # renames, nothing copied
                    (path / entry).rename(path / SET_ASIDE / entry)
        if dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
        torch_dist.barrier()  # every rank has looked for an earlier run before the log file below exists
        if dist.is_main:
            handler = logging.FileHandler(path / LOG)
            handler.setFormatter(logging.getLogger().handlers[0].formatter)
            logging.getLogger().addHandler(handler)
            log.info("run directory %s", path)
        return cls(path, dist, set_aside=set_aside, hold=hold)

    def start(self, name: str, cfg: Config, ds_config: dict[str, Any]) -> None:
        """Every rank passed its checks: an earlier run set aside goes for good, and the resolved config is written."""
        self.started = True
        if not self.dist.is_main:
            return
        if self.set_aside:
            log.warning("--overwrite: deleted the earlier run in %s", self.path)
            shutil.rmtree(self.path / SET_ASIDE)
        record = {
            "name": name,
            "commit": git_commit(),
            "world_size": self.dist.world_size,
            "config": to_dict(cfg),
            "deepspeed": ds_config,
        }
        write_text_atomically(self.path / CONFIG, json.dumps(record, indent=2) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.dist.is_main:
            write_text_atomically(self.path / SUMMARY, json.dumps(summary, indent=2) + "\n")

    def check_held(self) -> None:
        """Before writing a checkpoint, on every rank: HeldError where another run took the directory over (this
        one's hold was not renewed for a whole lease: a process stopped, or a file system gone that long)."""
        lost = [self.hold is not None and self.hold.lost]
        torch_dist.broadcast_object_list(lost, src=0)
        if lost[0]:
            raise HeldError(f"{self.path}: another run took the directory over; this one stops without saving")

    def close(self) -> None:
        """The run ends: an earlier run set aside by a run that did not start goes back, and the hold goes."""
        try:
            self._put_back()
        finally:
            if self.hold is not None:
                self.hold.release()

    def _put_back(self) -> None:
        """After a run that did not start: the earlier run set aside is put back where it was, replacing what the
        failed start wrote (its log, its metrics)."""
        if self.started or not self.set_aside or not self.dist.is_main:
            return
        aside = self.path / SET_ASIDE
        for entry in aside.iterdir():
            mine = self.path / entry.name
            if mine.exists():
                shutil.rmtree(mine) if mine.is_dir() else mine.unlink()
            entry.rename(mine)
        aside.rmdir()
        log.warning("--overwrite: the new run did not start; the earlier run in %s is back as it was", self.path)
