"""Checkpoints that are never lost and prove themselves: complete and on disk before they become the latest,
verified before they are resumed from, the newest few kept.

DeepSpeed writes a checkpoint into a directory named by its tag and then rewrites the file
``latest``; a process killed in between can leave ``latest`` naming a half-written checkpoint, or
``latest`` itself half-written. Here every rank writes into a hidden ``.<tag>.partial`` directory and
fsyncs what it wrote; only when all ranks are done does rank 0 record each file's size and SHA-256 in a
manifest, rename the directory to ``<tag>`` and replace ``latest`` atomically (a new file renamed over
the old). A kill or a failed write at any moment leaves the previous checkpoint loadable, and a failure
on any rank ends the save on every rank. ``--resume`` takes the newest checkpoint whose files match
its manifest; a damaged one is set aside (``model.checkpoints.set_aside``), never deleted.
Tags are global steps (``step00000048``), so that their order is the order of training.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import resource
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from common.files import fsync_path, size_text, write_text_atomically
from model.checkpoints import (
    CHECKPOINT_DIR,
    LATEST,
    PARTIAL_SAVE,
    REPLACED,
    checkpoint_tags,
    is_verifiable,
    latest_tag,
    newest_intact,
    set_aside,
    tag_for,
    write_manifest,
)
from trainer.config.sections import Checkpointing
from trainer.dist import is_main_process, on_any_rank
from trainer.errors import CheckpointError, NumericalError

log = logging.getLogger(__name__)


def weights_are_finite(engine: Any) -> bool:
    """True on every rank when no rank holds a NaN or Inf weight (one reduction)."""
    local = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    return not on_any_rank(engine.device, flag=not local)


def _on_any_rank(failed: Exception | None, device: torch.device) -> bool:
    """Whether a save failed on any rank (one reduction, in place of a barrier: no rank waits for one that failed)."""
    return on_any_rank(device, flag=failed is not None)


def _fsync_own_files(directory: Path, rank: int) -> None:
    """The files of ``directory`` that this rank wrote, on disk before the directory is renamed into place: the
    ZeRO optimizer states of its own partition, and on rank 0 everything else (DeepSpeed's model states)."""
    for path in sorted(directory.rglob("*")):
        owner = re.search(r"zero_pp_rank_(\d+)_", path.name)
        if path.is_file() and (int(owner[1]) if owner else 0) == rank:
            fsync_path(path)


def _in_torch_save(err: BaseException) -> bool:
    """Whether ``err`` came out of torch.save: its writer turns a failed write into a RuntimeError of its own
    ("unexpected pos", "iostream error"...), without the system's error number."""
    frames = traceback.extract_tb(err.__traceback__)
    return any(frame.filename.endswith(f"torch{os.sep}serialization.py") for frame in frames)


def _why(err: Exception | None, directory: Path) -> str:
    """Why a save failed, in a few words: the system's reason, or where torch's writer hides it, the likely one."""
    if err is None:
        return "it failed on another rank"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    written = (
        max((p.stat().st_size for p in directory.rglob("*") if p.is_file()), default=0) if directory.is_dir() else 0
    )
    if limit != resource.RLIM_INFINITY and written >= limit:
        return f"a file reached this process's file size limit of {limit:,} bytes, ulimit -f"
    free = shutil.disk_usage(directory.parent).free
    said = re.sub(r"^\[enforce fail at [^]]*\]\s*\.?\s*", "", " ".join(str(err).split()))
    return f"a write failed with {size_text(free)} free there: {said[:50]}"


def _failed(tag: str, ckpt_dir: Path, err: Exception | None) -> CheckpointError:
    return CheckpointError(
        f"saving checkpoint {tag} into {ckpt_dir} failed ({_why(err, ckpt_dir / f'.{tag}.partial')}): the "
        f"previous checkpoint and {LATEST} are as they were"
    )


def _publish(ckpt_dir: Path, partial: str, tag: str) -> None:
    """Rank 0: the manifest, then the partial directory renamed into place and made the latest. A checkpoint of the
    same step from before (a resumed run stopped again at once) is replaced only once the new one is latest; a
    failure part way puts the new one back where it was, so that the caller can remove it."""
    write_manifest(ckpt_dir / partial)
    fsync_path(ckpt_dir / partial)
    old = ckpt_dir / REPLACED.format(tag=tag)
    if (ckpt_dir / tag).exists():
        os.replace(ckpt_dir / tag, old)
    try:
        os.replace(ckpt_dir / partial, ckpt_dir / tag)
        fsync_path(ckpt_dir)
        write_text_atomically(ckpt_dir / LATEST, tag)
    except OSError:
        if (ckpt_dir / tag).exists() and not (ckpt_dir / partial).exists():
            os.replace(ckpt_dir / tag, ckpt_dir / partial)
        if old.exists():
            os.replace(old, ckpt_dir / tag)
        raise
    shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True, kw_only=True)
class Position:
    """Where training is: the optimizer steps taken, the epoch (0-based) and the micro-batches of it done."""

    step: int
    epoch: int
    batch_in_epoch: int


class Checkpointer:
    """Saves a run's checkpoints on every rank alike, and decides when (``reached``, called after each step and at each
    epoch's end): every ``every_epochs``-th epoch and the last, every ``every_steps`` steps, every ``every_minutes``
    minutes (rank 0's clock, agreed every ``agree_every`` steps), on a stop. A save due at an epoch's last step waits
    for the epoch's end, so that its checkpoint says the epoch is done. Rank 0 finishes each save (fsync, checksums,
    rename, ``latest``, pruning) in a thread while training goes on; the next save and ``finish`` wait for it, and a
    failure there ends the run on every rank."""

    def __init__(
        self,
        engine: Any,
        run_dir: Path,
        *,
        settings: Checkpointing,
        batches_per_epoch: int,
        agree_every: int,
        saved: Position | None = None,
        before_save: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine, self.ckpt_dir, self.settings = engine, run_dir / CHECKPOINT_DIR, settings
        self.before_save = before_save  # raises where the run no longer holds its directory
        self.batches_per_epoch, self.agree_every = batches_per_epoch, agree_every
        self.saved = saved  # the newest checkpoint's position: the one resumed from, then each this run saves
        self.rank = torch_dist.get_rank()
        self._last_save = time.monotonic()
        self._at_epoch_end = False  # a save due at an epoch's last step, made at the epoch's end
        self._publishing: threading.Thread | None = None
        self._published: tuple[str, Exception | None] | None = None  # the tag in the background, and its failure

    def reached(
        self,
        at: Position,
        state: Callable[[], dict[str, Any]],
        *,
        epoch_end: bool = False,
        last: bool = False,
        stopping: bool = False,
    ) -> str | None:
        """The loop is ``at`` a step's end, or with ``epoch_end`` an epoch's (after its validation); ``last`` after the
        run's last epoch. Saves where due, with ``state()`` as the client state (waited for on a stop and at the
        end); returns the tag saved, if any."""
        if stopping or last:
            return self.save(at, state, wait=True)
        if epoch_end:
            due, self._at_epoch_end = self._at_epoch_end or self._every(at.epoch, self.settings.every_epochs), False
        else:
            due = self._every(at.step, self.settings.every_steps) or self._clock_agreed(at.step)
            if due and at.batch_in_epoch == self.batches_per_epoch:
                due, self._at_epoch_end = False, True
        return self.save(at, state) if due else None

    @staticmethod
    def _every(count: int, every: int | None) -> bool:
        return bool(every and count % every == 0)

    def _clock_agreed(self, step: int) -> bool:
        """Every ``agree_every`` steps, whether rank 0's clock says a timed save is due (one small reduction)."""
        if self.settings.every_minutes is None or step % self.agree_every:
            return False
        due = time.monotonic() - self._last_save >= 60 * self.settings.every_minutes
        return on_any_rank(self.engine.device, flag=self.rank == 0 and due)

    def save(self, at: Position, state: Callable[[], dict[str, Any]], *, wait: bool = False) -> str | None:
        """Save the engine's state at ``at`` as the newest checkpoint, unless the newest is of this position already;
        returns its tag. With ``wait`` it is the latest on disk when this returns; else rank 0 finishes it in the
        background.

        Weights that are not finite are never saved (NumericalError). A write that fails on any rank is a
        CheckpointError on every rank, the partial directory removed and the previous checkpoint left the latest.
        """
        self._last_save = time.monotonic()  # a save of any kind is the clock's too
        if self.saved == at:  # saved already (a step's cadence, then a stop at that step)
            if wait:
                self.finish()
            return None
        self.finish()
        self.before_save()
        engine, ckpt_dir = self.engine, self.ckpt_dir
        client_state = state()
        tag = tag_for(engine.global_steps)
        if not weights_are_finite(engine):
            raise NumericalError(
                f"weights at step {engine.global_steps} are not finite: not saving them (the last checkpoint is kept)"
            )
        failed: Exception | None = None
        if self.rank == 0:  # made here, so that DeepSpeed's own making of it, before its first barrier, cannot fail
            try:
                ckpt_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                failed = err
        if _on_any_rank(failed, engine.device):
            raise _failed(tag, ckpt_dir, failed)
        partial = PARTIAL_SAVE.format(tag=tag)
        try:
            engine.save_checkpoint(str(ckpt_dir), tag=partial, client_state=client_state, save_latest=False)
        except (OSError, RuntimeError) as err:
            if isinstance(err, RuntimeError) and not _in_torch_save(err):
                raise
            failed = err
            torch_dist.barrier()  # the one DeepSpeed's save ends with, where the other ranks wait
        if failed is None and self.rank != 0:
            try:
                _fsync_own_files(ckpt_dir / partial, self.rank)
            except OSError as err:
                failed = err
        if _on_any_rank(failed, engine.device):
            self._fail(tag, failed)
        if self.rank == 0:
            self._published = (tag, None)
            self._publishing = threading.Thread(target=self._publish, args=(tag,), name=f"publish {tag}")
            self._publishing.start()
        if wait:
            self.finish()
        torch_dist.barrier()
        self.saved = at
        log.info("checkpoint %s saved", tag)
        return tag

    def _publish(self, tag: str) -> None:
        """Rank 0, in the background: its files on disk, then the checkpoint made the latest, the oldest pruned."""
        try:
            partial = self.ckpt_dir / PARTIAL_SAVE.format(tag=tag)
            _fsync_own_files(partial, 0)
            _publish(self.ckpt_dir, partial.name, tag)
            _prune(self.ckpt_dir, self.settings.keep)
        except Exception as err:  # any failure is said on every rank by finish(), never lost with the thread
            self._published = (tag, err)

    def finish(self) -> None:
        """Wait for the checkpoint rank 0 is finishing; where that failed, a CheckpointError on every rank."""
        tag, failed = None, None
        if self._publishing is not None:
            self._publishing.join()
            self._publishing = None
            tag, failed = self._published
        tags = [tag]
        if _on_any_rank(failed, self.engine.device):
            torch_dist.broadcast_object_list(tags, src=0)
            self._fail(tags[0], failed)

    def _fail(self, tag: str, failed: Exception | None) -> None:
        error = _failed(tag, self.ckpt_dir, failed)  # said while what was written is still there to measure
        if self.rank == 0:
            shutil.rmtree(self.ckpt_dir / PARTIAL_SAVE.format(tag=tag), ignore_errors=True)
        raise error


def _prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; remove the rest (a killed save's leftovers are reclaimed, and
    said, when the next run starts: ``model.checkpoints.reclaim_temporaries``)."""
    for old in checkpoint_tags(ckpt_dir.parent)[:-keep]:
        shutil.rmtree(ckpt_dir / old)


def choose_checkpoint(run_dir: Path) -> str:
    """The newest checkpoint whose files match its manifest (or, written before manifests, that has none); each
    newer one that does not is named in a warning and set aside. Rank 0's choice; a CheckpointError where none is
    left, naming each one tried."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    tag, damaged = newest_intact(run_dir)
    if tag is None:
        if not damaged:
            raise CheckpointError(f"--resume: no checkpoint in {ckpt_dir}")
        tried = "; ".join(f"{t}: {problem}" for t, problem in damaged)
        raise CheckpointError(f"--resume: no intact checkpoint in {ckpt_dir} ({tried})")
    for bad, problem in damaged:
        aside = set_aside(run_dir, bad)
        log.warning("checkpoint %s is damaged (%s): set aside as %s", ckpt_dir / bad, problem, aside.name)
    if damaged:
        log.warning("resuming from %s, the newest intact checkpoint", tag)
    if not is_verifiable(ckpt_dir / tag):
        log.warning("checkpoint %s has no manifest (written before checkpoints were verified): resumed unverified", tag)
    if latest_tag(run_dir) != tag:
        write_text_atomically(ckpt_dir / LATEST, tag)
    return tag


def _agreed_checkpoint(run_dir: Path) -> str:
    """Rank 0 verifies and chooses; every rank gets the same tag, or the same error."""
    choice: list[Any] = [None]
    if is_main_process():
        try:
            choice[0] = choose_checkpoint(run_dir)
        except CheckpointError as err:
            choice[0] = err
        except Exception as err:  # an unreadable disk, a rename refused: said on every rank, none left waiting
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            where = f" ({err.filename})" if isinstance(err, OSError) and err.filename else ""
            choice[0] = CheckpointError(f"--resume: checking the checkpoints failed{where}: {reason}")
    torch_dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], CheckpointError):
        raise choice[0]
    return choice[0]


# What torch says of a file it cannot read as a checkpoint, as opposed to one that does not fit the model.
_UNREADABLE = ("PytorchStreamReader", "central directory", "unpickl", "EOF", "invalid load key", "zip archive")


def load_checkpoint(engine: Any, run_dir: Path) -> dict[str, Any]:
    """Load the newest intact checkpoint of ``run_dir`` into the engine (the same on every rank); its client state."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    tag = _agreed_checkpoint(run_dir)
    try:
        path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    except ZeRORuntimeException:
        saved = engine.loaded_checkpoint_dp_world_size
        raise CheckpointError(
            f"--resume: checkpoint {ckpt_dir / tag} holds ZeRO optimizer states split over {saved} rank(s), this run "
            f"has {engine.dp_world_size}: resume on {saved} rank(s) (DeepSpeed cannot split them anew)"
        ) from None
    except (RuntimeError, KeyError, ValueError, OSError, EOFError, pickle.UnpicklingError) as err:
        said = " ".join(str(err).split()) or type(err).__name__
        first = said.split(". ")[0][:80]
        if any(sign in f"{type(err).__name__} {said}" for sign in _UNREADABLE):
            raise CheckpointError(f"--resume: checkpoint {ckpt_dir / tag} is damaged ({first})") from None
        raise CheckpointError(f"--resume: checkpoint {ckpt_dir / tag} does not fit this model ({first})") from None
    if path is None:
        raise CheckpointError(f"--resume: checkpoint {ckpt_dir / tag} could not be loaded")
    return client_state
