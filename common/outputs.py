"""What the project wrote where, so that no command changes a file it did not write.

A directory the project writes into carries a mark, ``.cosmo-emulator.json``, naming the entries its commands wrote
there, each marked before it is written. An entry not marked is the user's: a command that owns its output directory
(a run, a prediction) refuses one holding any unless told to write beside them (``claim_directory``), and no command
replaces one (``claim_file``). Where content proves an entry the project's (``legacy``), it counts as marked: for
files always, for a directory's entries only where the directory has no mark (written before marks existed).
``refuse_inputs``: no output is one of the command's inputs. docs/troubleshooting.md tells the rules.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from common.files import PARTIAL, write_text_atomically
from common.hold import hold_file

MARK = ".cosmo-emulator.json"
MARK_WAIT_S = 60.0  # writers of one directory take turns at its mark; an update takes milliseconds
# The project's own hidden names, never outputs: holds (and their records' temporaries), temporaries, the mark.
_MACHINERY = re.compile(rf"^\.(.+\.)?(hold|hold\.json(\.[\w-]+)?)$|^\..+{re.escape(PARTIAL)}$")
Legacy = Callable[[Path], bool]  # whether an entry is the project's by what it holds


class OutputError(ValueError):
    """An output that would change what the project did not write, or an input; the message is one line."""


def marked(directory: Path) -> dict[str, str]:
    """The entries of ``directory`` the project marked, each with the command that wrote it ({} without a mark)."""
    try:
        written = json.loads((directory / MARK).read_text())["written"]
    except (OSError, ValueError, KeyError, TypeError):  # none, or not ours to read: nothing counts as marked
        return {}
    return {str(name): str(by) for name, by in written.items()} if isinstance(written, dict) else {}


def mark(directory: Path, names: Iterable[str], *, by: str) -> None:
    """Add ``names`` to the mark of ``directory`` (made if need be) as written by command ``by``: before writing."""
    names = list(names)
    _update(directory, lambda written: written | {name: written.get(name, by) for name in names})


def _update(directory: Path, change: Callable[[dict[str, str]], dict[str, str]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with hold_file(directory / MARK, "it is updated in milliseconds: stop it if it is stuck", wait_s=MARK_WAIT_S):
        before = marked(directory)
        after = change(before)
        if after != before or not (directory / MARK).is_file():
            about = "entries of this directory that cosmo-emulator's commands wrote; any other entry is the user's"
            record = {"about": about, "written": dict(sorted(after.items()))}
            write_text_atomically(directory / MARK, json.dumps(record, indent=1) + "\n")


def is_machinery(name: str) -> bool:
    """Whether ``name`` is one of the project's hidden working files (a hold, a temporary, the mark)."""
    return name == MARK or bool(_MACHINERY.match(name))


def foreign(directory: Path, *, legacy: Legacy | None = None) -> list[str]:
    """The entries of ``directory`` the project did not write: not marked, not its working files, not a directory
    with a mark of its own, and (where ``directory`` has no mark) not the project's by content (``legacy``)."""
    if not directory.is_dir():
        return []
    written, unmarked_dir = marked(directory), not (directory / MARK).exists()
    found = []
    for entry in sorted(directory.iterdir()):
        if entry.name in written or is_machinery(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink() and (entry / MARK).is_file():
            continue
        if unmarked_dir and legacy is not None and legacy(entry):
            continue
        found.append(entry.name)
    return found


def listed(names: list[str], most: int = 4) -> str:
    """A few names, and how many more."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def claim_directory(
    directory: Path, names: Collection[str], *, by: str, beside: bool, legacy: Legacy | None = None, advice: str
) -> None:
    """Before command ``by`` writes ``names`` into ``directory``: ``check_directory``, then the names are marked, and
    the entries written before marks existed (``legacy``) with them."""
    earlier = check_directory(directory, names, beside=beside, legacy=legacy, advice=advice)
    mark(directory, [*earlier, *names], by=by)


def check_directory(
    directory: Path, names: Collection[str], *, beside: bool, legacy: Legacy | None = None, advice: str
) -> list[str]:
    """OutputError where ``directory`` holds entries the project did not write (unless ``beside``; never where one
    has a name in ``names``); else the entries of an unmarked directory that are the project's by content, to mark.
    ``advice`` ends a refusal: what else to do."""
    found = foreign(directory, legacy=legacy)
    clash = [name for name in found if name in names]
    if clash:
        raise OutputError(
            f"{directory} holds {listed(clash)}, which this project did not write and never replaces: move "
            f"{'it' if len(clash) == 1 else 'them'}, or {advice}"
        )
    if found and not beside:
        raise OutputError(
            f"{directory} holds files this project did not write ({listed(found)}): --beside writes beside them "
            f"without touching them, or {advice}"
        )
    return [] if not directory.is_dir() or (directory / MARK).exists() else _adopted(directory, found, legacy)


def _adopted(directory: Path, found: list[str], legacy: Legacy | None) -> list[str]:
    """The entries of an unmarked directory that its content shows the project wrote: marked from now on."""
    if legacy is None:
        return []
    return [e.name for e in directory.iterdir() if e.name not in found and not is_machinery(e.name) and legacy(e)]


def claim_files(paths: list[Path], *, by: str, overwrite: bool, legacy: Legacy | None = None, advice: str) -> None:
    """Before command ``by`` writes files ``paths``: OutputError where one is there that the project did not write
    (never replaced, whatever ``overwrite`` says), or that it wrote and ``overwrite`` is not given; else they are
    marked. ``advice`` ends a refusal: what else to do."""
    there = [p for p in paths if p.exists() or p.is_symlink()]
    theirs = [p for p in there if p.name not in marked(p.parent) and not (legacy is not None and legacy(p))]
    if theirs:
        one = len(theirs) == 1
        raise OutputError(
            f"{listed([str(p) for p in theirs])} {'was' if one else 'were'} not written by this project and "
            f"{'is' if one else 'are'} never replaced: move {'it' if one else 'them'}, or {advice}"
        )
    if there and not overwrite:
        verb, them = ("exists", "it") if len(there) == 1 else ("exist", "them")
        raise OutputError(f"{' and '.join(map(str, there))} {verb}: --overwrite replaces {them}, or {advice}")
    for directory in {p.parent for p in paths}:
        mark(directory, [p.name for p in paths if p.parent == directory], by=by)


def refuse_inputs(outputs: Iterable[Path], inputs: Iterable[Path | None]) -> None:
    """OutputError where an output is one of the inputs, or holds one (the same file through links, hard links or
    other names), before anything is written."""
    inputs = [p for p in inputs if p is not None]
    for out in outputs:
        for source in inputs:
            if _same(out, source):
                raise OutputError(f"{out} is the input {source}: an output never replaces an input; choose another")
            if _inside(source, out):
                raise OutputError(f"{out}, which the command writes, holds the input {source}: choose another output")


def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def _inside(source: Path, out: Path) -> bool:
    return out.is_dir() and source.resolve().is_relative_to(out.resolve()) and not _same(out, source)
