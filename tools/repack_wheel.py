"""A wheel's contents for one Python version, as a tar.xz to extract into a site directory.

Wheels such as DALI's carry a compiled module per CPython version (``backend_impl.cpython-312-x86_64-linux-gnu.so``
and its siblings for 3.10 to 3.15): a machine needs one of them. Extracting the archive where ``pip install
--target`` would put the wheel gives the same importable package (for wheels without a ``.data`` directory, which
pip would move elsewhere: such wheels are refused).

    python -m tools.repack_wheel WHEEL 3.12 OUT.tar.xz
"""

from __future__ import annotations

import argparse
import re
import sys
import tarfile
import zipfile
from pathlib import Path

# The CPython tag in a compiled module's name: 'cpython-312-' or, free-threaded, 'cpython-313t-'.
_CPYTHON = re.compile(r"\.cpython-(\d+t?)-")


def kept(name: str, version_tag: str) -> bool:
    """Whether a member of the wheel belongs in the archive for CPython ``version_tag`` ('312')."""
    match = _CPYTHON.search(name)
    return match is None or match[1] == version_tag


def repack(wheel: Path, python_version: str, out: Path) -> tuple[int, int]:
    """Write ``out`` from ``wheel``, less the other versions' compiled modules; (members kept, members left out).
    ValueError for a wheel this cannot stand in for: one with a ``.data`` directory (pip moves its contents
    elsewhere), or with compiled modules but none for ``python_version``."""
    tag = python_version.replace(".", "")
    kept_count = left_out = 0
    with zipfile.ZipFile(wheel) as source:
        names = [m.filename for m in source.infolist()]
        if any(name.split("/")[0].endswith(".data") for name in names):
            raise ValueError(f"{wheel.name} has a .data directory, which pip installs elsewhere: ship the wheel itself")
        compiled = [name for name in names if _CPYTHON.search(name)]
        if compiled and not any(kept(name, tag) for name in compiled):
            raise ValueError(f"{wheel.name} has no compiled module for Python {python_version}")
    with zipfile.ZipFile(wheel) as source, tarfile.open(out, "w:xz") as archive:
        for member in source.infolist():
            if member.is_dir():
                continue
            if not kept(member.filename, tag):
                left_out += 1
                continue
            info = tarfile.TarInfo(member.filename)
            info.size = member.file_size
            info.mode = (member.external_attr >> 16) & 0o777 or 0o644
            with source.open(member) as data:
                archive.addfile(info, data)
            kept_count += 1
    return kept_count, left_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.repack_wheel", description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("python_version", help="the target machine's, e.g. 3.12")
    parser.add_argument("out", type=Path, help="the .tar.xz to write")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"python_version must be like 3.12, got {args.python_version!r}")
    try:
        kept_count, left_out = repack(args.wheel, args.python_version, args.out)
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        print(f"python -m tools.repack_wheel: cannot repack {args.wheel}: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {kept_count} files for Python {args.python_version}, {left_out} for other versions left out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
