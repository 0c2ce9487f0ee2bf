"""What every benchmark record carries about where and with what it ran."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

from common.files import write_text_atomically
from common.hold import HeldError, hold_file
from trainer.provenance import REPO as REPO  # re-exported for the benchmarks
from trainer.provenance import cpu_info, git_commit, software

APPEND_WAIT_S = 120.0  # an append takes milliseconds: a holder for longer is stuck


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append one JSON line per record, starting on a line of its own after a record cut short (a run killed
    while writing it), so that the fragment never swallows the next record; only to a results file of the project's.
    Benchmarks appending to one file at once take turns (a hold on the file), so that their records never
    interleave, on a shared file system too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = "".join(json.dumps(r) + "\n" for r in records)
    try:
        hold = hold_file(path, "stop it if it is stuck", wait_s=APPEND_WAIT_S)
    except HeldError as err:
        print(kept, end="")  # the records, kept on stdout
        _fail(f"{err}; the records above were not appended (waited {APPEND_WAIT_S:g} s)")
    with hold:
        if path.exists() and not _records_file(path):  # records say what they are: no mark beside them
            print(kept, end="")
            _fail(f"{path} is not a results file of this project: the records above were not appended; choose another")
        _append(path, kept)


def _records_file(path: Path) -> bool:
    """Whether ``path`` holds benchmark records only (one JSON object with a "bench" key a line; the last may be
    cut short): a results file written before marks existed."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    lines = text.splitlines()
    complete = lines if text.endswith("\n") else lines[:-1]
    if len(complete) < len(lines) and not lines[-1].startswith("{"):
        return False
    for line in filter(str.strip, complete):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return False
        if not isinstance(record, dict) or "bench" not in record:
            return False
    return True


def _append(path: Path, text: str) -> None:
    with path.open("ab+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(text.encode())


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a results file, one per line. A line that is not one (the last record of a run killed
    while writing it) is skipped with a warning; a missing or empty file ends the command in one line."""
    if not path.is_file():
        _fail(f"{path}: no such results file")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            print(f"warning: {path} line {number} is not a JSON record (a write cut short?): skipped", file=sys.stderr)
            continue
        records.append(record)
    if not records:
        _fail(f"{path}: no records")
    return records


def _cpu_model() -> str:
    return cpu_info().model or platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "host": socket.gethostname(),
        "device": gpu or "cpu",
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        **software(),
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


DOC = REPO / "docs" / "benchmarks.md"  # the page whose tables bench.pipeline and bench.report regenerate


def update_doc(doc: Path, text: str, name: str = "pipeline") -> None:
    """Replace what stands between the ``bench:<name>`` markers in the markdown page ``doc`` with ``text``, the page
    replaced whole (never half written); a page without both markers ends the command in one line."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    content = doc.read_text()
    if start not in content or end not in content.split(start, 1)[1]:
        _fail(f"{doc} has no {start} ... {end} markers to put the table between")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    write_text_atomically(doc, f"{head}{start}\n{text}\n{end}{tail}")
