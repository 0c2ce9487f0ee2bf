"""Results name the project's own commit, also from a copy of the project inside another git checkout or on a
machine without its repository."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.conftest import REPO
from trainer.provenance import git_commit


def _commit_seen_from(project) -> str:
    command = [sys.executable, "-c", "from trainer.provenance import git_commit; print(git_commit())"]
    return subprocess.run(command, cwd=project, capture_output=True, text=True, check=True).stdout.strip()


def _git(cwd, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    command = ["git", "-c", "init.defaultBranch=main", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=True, env=env).stdout.strip()


def test_a_copy_inside_another_checkout_does_not_take_its_commit(tmp_path):
    outer = tmp_path / "outer"
    outer.mkdir()
    _git(outer, "init", "-q")
    (outer / "notes.txt").write_text("another project\n")
    _git(outer, "add", "notes.txt")
    _git(outer, "commit", "-q", "-m", "outer")
    project = outer / "copy"
    for layer in ("trainer", "common"):  # the trainer and what it stands on
        shutil.copytree(REPO / layer, project / layer, ignore=shutil.ignore_patterns("__pycache__"))
    assert _git(project, "rev-parse", "--short", "HEAD")  # git would answer with the outer checkout's commit
    assert _commit_seen_from(project) == "unknown"
    # The copy carries the commit it was made from, written in the repository before copying (a stamp there
    # before the test is put back).
    earlier = (REPO / "COMMIT").read_bytes() if (REPO / "COMMIT").exists() else None
    stamp = subprocess.run(
        [sys.executable, "-m", "trainer.provenance"], cwd=REPO, capture_output=True, text=True, check=True
    )
    try:
        assert stamp.stdout.strip() == f"COMMIT: {git_commit()}"
        shutil.copy(REPO / "COMMIT", project / "COMMIT")
    finally:
        if earlier is None:
            (REPO / "COMMIT").unlink()
        else:
            (REPO / "COMMIT").write_bytes(earlier)
    assert _commit_seen_from(project) == git_commit() != "unknown"
