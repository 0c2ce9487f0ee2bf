"""Writing files so that a reader never sees half of one, and an interrupted write leaves nothing behind: a write goes
to a hidden temporary name beside the file, renamed into place when whole; what a killed writer left under such a
name is found (``temporaries``) and reclaimed by the next writer of the same file (``reclaim``). Sizes are said
with ``size_text``.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL = ".partial"  # the suffix of every temporary name: ``.<name>.partial`` or ``.<name>.<random>.partial``


def size_text(nbytes: float) -> str:
    """A size with the unit that shows it: GiB from a quarter of one, else MiB, KiB or bytes."""
    if nbytes >= 2**28:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    if nbytes >= 2**10:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes:.0f} bytes"


@contextmanager
def written_atomically(path: Path) -> Iterator[Path]:
    """A hidden file next to ``path`` to write into: it replaces ``path`` when the block ends normally and is
    removed when it raises. Its name is unique, so writers on several nodes of a shared file system do not
    collide; its permissions follow the umask, like any file the user creates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    tmp = Path(name)
    tmp.chmod(0o666 & ~umask)  # mkstemp makes it private
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        if err.errno is None or not err.strerror:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from None  # said of the file meant, not the hidden one
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once, the content on disk (fsync) before the rename: a crash leaves the
    old file or the new one, never an empty one."""
    with written_atomically(path) as tmp:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """Make what was written to file ``path``, or the renames inside directory ``path``, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporaries(directory: Path, names: Iterable[str]) -> list[Path]:
    """What writers of ``names`` in ``directory`` left under a temporary name (``.<name>.partial``, or with a random
    part before the suffix): files and directories, which only a writer killed part way leaves."""
    found: set[Path] = set()
    for name in names:
        literal = glob.escape(name)
        for pattern in (f".{literal}{PARTIAL}", f".{literal}.*{PARTIAL}"):
            found.update(directory.glob(pattern))
    return sorted(found)


def size_of(path: Path) -> int:
    """The bytes of a file, or of a directory's files, as ``ls -l`` shows them."""
    paths = [path, *path.rglob("*")] if path.is_dir() and not path.is_symlink() else [path]
    total = 0
    for each in paths:
        try:
            total += each.lstat().st_size if not each.is_dir() else 0
        except OSError:  # gone meanwhile
            continue
    return total


def reclaim(paths: list[Path], *, what: str) -> str:
    """Remove ``paths`` (files or directories); the line that says so, what and how big ("" where there were none)."""
    if not paths:
        return ""
    size = sum(size_of(p) for p in paths)
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    where = Path(os.path.commonpath([p.parent for p in paths]))
    names = [str(p.relative_to(where)) for p in paths]
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"reclaimed {what} in {where}: {listed} ({size_text(size)})"
