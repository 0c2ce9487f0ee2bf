"""Checkpoints that are never lost: complete before they become the latest, the newest few kept.

DeepSpeed writes a checkpoint into a directory named by its tag and then rewrites the file
``latest``; a process killed in between can leave ``latest`` naming a half-written checkpoint, or
``latest`` itself half-written. Here every rank writes into a hidden ``.<tag>.partial`` directory;
only when all ranks are done does rank 0 rename it to ``<tag>`` and replace ``latest`` atomically
(a new file renamed over the old). A kill at any moment leaves the previous checkpoint loadable.
Tags are global steps (``step00000048``), so that their order is the order of training.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from model.checkpoints import CHECKPOINT_DIR, LATEST, TAG_PREFIX, checkpoint_tags, latest_tag, tag_for
from pipeline.files import fsync_dir, write_text_atomically
from trainer.errors import CheckpointError, NumericalError


def weights_are_finite(engine: Any) -> bool:
    """True on every rank when no rank holds a NaN or Inf weight (one reduction)."""
    local = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    flag = torch.tensor([0.0 if local else 1.0], device=engine.device)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
    return flag.item() == 0.0


def save_checkpoint(engine: Any, run_dir: Path, client_state: dict[str, Any], keep: int) -> str:
    """Save the engine's state as the newest checkpoint, on every rank; returns its tag.

    Refuses (NumericalError) to save weights that are not finite: a NaN model must not replace a
    good checkpoint.
    """
    ckpt_dir = run_dir / CHECKPOINT_DIR
    tag = tag_for(engine.global_steps)
    if not weights_are_finite(engine):
        raise NumericalError(
            f"weights at step {engine.global_steps} are not finite: not saving them (the last checkpoint is kept)"
        )
    partial = f".{tag}.partial"
    engine.save_checkpoint(str(ckpt_dir), tag=partial, client_state=client_state, save_latest=False)
    torch_dist.barrier()
    if torch_dist.get_rank() == 0:
        if (ckpt_dir / tag).exists():  # the same step saved before (a resumed run stopped again at once)
            shutil.rmtree(ckpt_dir / tag)
        os.replace(ckpt_dir / partial, ckpt_dir / tag)
        fsync_dir(ckpt_dir)
        write_text_atomically(ckpt_dir / LATEST, tag)
        _prune(ckpt_dir, keep)
    torch_dist.barrier()
    return tag


def _prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; remove the rest and any partial leftovers."""
    for old in checkpoint_tags(ckpt_dir.parent)[:-keep]:
        shutil.rmtree(ckpt_dir / old)
    for leftover in ckpt_dir.glob(f".{TAG_PREFIX}*.partial"):
        shutil.rmtree(leftover, ignore_errors=True)


def load_checkpoint(engine: Any, run_dir: Path) -> dict[str, Any]:
    """Load the latest checkpoint of ``run_dir`` into the engine; its client state."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    tag = latest_tag(run_dir)
    if tag is None:
        raise CheckpointError(f"--resume: no checkpoint in {ckpt_dir}")
    if not (ckpt_dir / tag).is_dir():
        raise CheckpointError(f"--resume: {ckpt_dir / LATEST} names {tag}, which is missing")
    try:
        path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    except ZeRORuntimeException:
        saved = engine.loaded_checkpoint_dp_world_size
        raise CheckpointError(
            f"--resume: checkpoint {ckpt_dir / tag} holds ZeRO optimizer states split over {saved} rank(s), this run "
            f"has {engine.dp_world_size}: resume on {saved} rank(s) (DeepSpeed cannot split them anew)"
        ) from None
    except (RuntimeError, KeyError, ValueError, OSError, EOFError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"--resume: checkpoint {ckpt_dir / tag} does not fit this model: {first}") from None
    if path is None:
        raise CheckpointError(f"--resume: checkpoint {ckpt_dir / tag} could not be loaded")
    return client_state
