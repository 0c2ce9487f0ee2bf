"""Which code produced a result: recorded in every run directory and benchmark record."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str | None:
    """HEAD, marked +dirty when code differs from it (documentation and results do not count)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":!*.md", ":!bench/results"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if status else "")
    except (OSError, subprocess.CalledProcessError):
        return None
