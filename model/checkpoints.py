"""Where a run directory keeps its config and its checkpoints: the layout the trainer writes and every reader
(``--resume``, the emulator, prediction) finds them by.

``config.json`` holds the resolved config; ``checkpoints/<tag>/`` one DeepSpeed checkpoint per tag (``step`` and
the global step, so that their order is the order of training), with the module's weights in
``mp_rank_00_model_states.pt``; ``checkpoints/latest`` names the newest complete one.
"""

from __future__ import annotations

from pathlib import Path

RUN_CONFIG = "config.json"
CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
TAG_PREFIX = "step"
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file of the module's weights (one model-parallel rank)


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def latest_tag(run_dir: Path) -> str | None:
    """The tag that ``latest`` names, or None where there is none yet."""
    try:
        tag = (run_dir / CHECKPOINT_DIR / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return tag or None


def checkpoint_tags(run_dir: Path) -> list[str]:
    """The complete checkpoints of a run, oldest first."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(TAG_PREFIX))
