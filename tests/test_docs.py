"""The README is a short front page whose links lead somewhere; the docs pages link to what exists."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page) -> set[str]:
    """GitHub's anchors for the headings of a markdown page."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_opens_with_the_two_commands_and_stays_short():
    lines = (REPO / "README.md").read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in lines[2:6] if line.strip() and not line.startswith("```")]
    assert commands == ["make train", "make test"]
    assert len(lines) <= 130


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in _anchors(resolved), f"{page.name}: no heading for #{anchor} in {resolved.name}"
