"""CONTRIBUTING.md's tables are the architecture's test: each common change is named file by file, every file and
every name they give exists, and no change needs more than three code files."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

PAGE = REPO / "CONTRIBUTING.md"
MAX_CODE_FILES = 3
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def changes() -> dict[str, list[tuple[list[str], str]]]:
    """Per '## Add ...' section: its table's rows, as (the files of the first cell, the second cell)."""
    found: dict[str, list[tuple[list[str], str]]] = {}
    section = None
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:] if line.startswith("## Add ") else None
            found.setdefault(section, []) if section else None
        elif section and line.startswith("| `"):
            first, what = (cell.strip() for cell in line.strip("|").split("|", 1))
            found[section].append((re.findall(r"`([^`]+)`", first), what))
    return found


CHANGES = changes()


def _is_code(path: str) -> bool:
    return path.endswith((".py", ".sh")) and not path.startswith(("tests/", "docs/"))


def test_the_page_lists_the_common_changes():
    assert {
        "Add a learning-rate scaling rule",
        "Add a learning-rate schedule shape",
        "Add a storage mode",
        "Add a loss term",
        "Add a benchmark sweep",
        "Add a tile blending",
    } <= set(CHANGES)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_names_files_that_exist_and_names_that_are_in_them(change):
    for files, what in CHANGES[change]:
        for path in files:
            assert (REPO / path).is_file(), f"{change}: {path} does not exist"
        names = [n for n in re.findall(r"`([^`]+)`", what) if IDENTIFIER.match(n)]
        text = "".join((REPO / path).read_text() for path in files)
        missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", text) and n.rstrip("_") not in text]
        assert missing == [], f"{change}: {', '.join(files)} hold no {missing}"


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_needs_at_most_three_code_files(change):
    code = sorted({path for files, _ in CHANGES[change] for path in files if _is_code(path)})
    assert 1 <= len(code) <= MAX_CODE_FILES, f"{change}: {code}"
