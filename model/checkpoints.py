"""Where a run directory keeps its config and its checkpoints: the layout the trainer writes and every reader
(``--resume``, the emulator, prediction) finds them by.

``config.json`` holds the resolved config; ``checkpoints/<tag>/`` one DeepSpeed checkpoint per tag (``step`` and
the global step, so that their order is the order of training), with the module's weights in
``mp_rank_00_model_states.pt`` and ``manifest.json``, every other file's size and SHA-256, written when the
checkpoint was complete; ``checkpoints/latest`` names the newest complete one. A checkpoint found damaged is set
aside as ``<tag>.damaged`` (``.damaged-2``... beside an earlier one): no longer a tag, never reused, never pruned.
What a killed save left under a temporary name is reclaimed at the next start (``reclaim_temporaries``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from common.files import reclaim, temporaries, write_text_atomically

RUN_CONFIG = "config.json"
CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
TAG_PREFIX = "step"
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file of the module's weights (one model-parallel rank)
MANIFEST = "manifest.json"
DAMAGED = ".damaged"
PARTIAL_SAVE = ".{tag}.partial"  # a save in progress: renamed to its tag once complete
REPLACED = ".{tag}.replaced"  # a checkpoint of the same step, set aside while the new one takes its name


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
    """The complete checkpoints of a run, oldest first (not those set aside as damaged)."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and re.fullmatch(rf"{TAG_PREFIX}\d+", p.name))


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(checkpoint: Path) -> None:
    """Record the size and SHA-256 of every file of a complete checkpoint in its manifest (written atomically)."""
    files = {
        p.relative_to(checkpoint).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    write_text_atomically(checkpoint / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")


def is_verifiable(checkpoint: Path) -> bool:
    """Whether the checkpoint has a manifest (checkpoints written before manifests existed have none)."""
    return (checkpoint / MANIFEST).is_file()


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint's files, in a few words naming the first damaged file (missing, truncated,
    longer than written, checksum mismatch), or None where every file is as its manifest says. A checkpoint
    without a manifest cannot be checked: None, where ``is_verifiable`` tells the difference."""
    if not checkpoint.is_dir():
        return "missing"
    if not is_verifiable(checkpoint):
        return None
    try:
        files = json.loads((checkpoint / MANIFEST).read_text())["files"]
        expected = {name: (int(f["bytes"]), str(f["sha256"])) for name, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} unreadable"
    for name, (size, digest) in expected.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} missing"
        try:
            actual = path.stat().st_size
            if actual < size:
                return f"{name} truncated: {actual:,} of {size:,} bytes"
            if actual > size:
                return f"{name} longer than written: {actual:,} bytes, not {size:,}"
            if _sha256(path) != digest:
                return f"{name} checksum mismatch"
        except OSError as err:
            return f"{name} unreadable ({err.strerror or err})"
    return None


def set_aside(run_dir: Path, tag: str) -> Path:
    """Rename a damaged checkpoint to ``<tag>.damaged`` (``.damaged-2``... beside earlier ones); the new path."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    aside, n = ckpt_dir / f"{tag}{DAMAGED}", 1
    while aside.exists():
        n += 1
        aside = ckpt_dir / f"{tag}{DAMAGED}-{n}"
    (ckpt_dir / tag).rename(aside)
    return aside


def newest_intact(run_dir: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint up to the one ``latest`` names (where it names one) whose files are as their manifest
    says, and the (tag, problem) of each newer one that is not. A checkpoint without a manifest passes where the run
    has none (written before manifests existed); beside checkpoints that have one, its manifest is missing."""
    tags = checkpoint_tags(run_dir)
    latest = latest_tag(run_dir)
    if latest in tags:
        tags = tags[: tags.index(latest) + 1]
    verified_run = any(is_verifiable(run_dir / CHECKPOINT_DIR / t) for t in tags)
    damaged = []
    for tag in reversed(tags):
        checkpoint = run_dir / CHECKPOINT_DIR / tag
        problem = checkpoint_problem(checkpoint)
        if problem is None and verified_run and not is_verifiable(checkpoint):
            problem = f"{MANIFEST} missing"
        if problem is None:
            return tag, damaged
        damaged.append((tag, problem))
    return None, damaged


def reclaim_temporaries(run_dir: Path) -> list[str]:
    """At a start that holds the run directory: what killed saves left in ``checkpoints/`` goes (partial checkpoints,
    ``latest``'s temporaries); a checkpoint set aside to be replaced whose replacement never took its name is put
    back. The lines that say so."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        return []
    lines: list[str] = []
    stale = sorted(ckpt_dir.glob(PARTIAL_SAVE.format(tag=f"{TAG_PREFIX}*"))) + temporaries(ckpt_dir, [LATEST])
    for aside in sorted(ckpt_dir.glob(REPLACED.format(tag=f"{TAG_PREFIX}*"))):
        tag = aside.name[1 : -len(".replaced")]
        if (ckpt_dir / tag).exists():
            stale.append(aside)
        else:
            os.replace(aside, ckpt_dir / tag)
            lines.append(f"checkpoint {tag} put back from {aside.name}, where a killed save had set it aside")
    return [line for line in [*lines, reclaim(sorted(stale), what="what killed saves left")] if line]
