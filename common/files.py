"""Writing files so that a reader never sees half of one, and an interrupted write leaves nothing behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def written_atomically(path: Path) -> Iterator[Path]:
    """A hidden file next to ``path`` to write into: it replaces ``path`` when the block ends normally and is
    removed when it raises. Its name is unique, so writers on several nodes of a shared file system do not
    collide; its permissions follow the umask, like any file the user creates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
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
