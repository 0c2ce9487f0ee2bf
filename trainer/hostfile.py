"""Check a DeepSpeed hostfile before the launcher reads it: one clear line per problem.

    python -m trainer.hostfile HOSTFILE        # prints the hosts and slots, or the first problem (exit 2)

Format: one line per node, ``<hostname> slots=<ranks>``; ``#`` starts a comment; blank lines are ignored.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from common.cli import ArgumentParser, existing_file
from trainer.errors import HostfileError

_LINE = re.compile(r"^(?P<host>[A-Za-z0-9][A-Za-z0-9._-]*)\s+slots=(?P<slots>\d+)$")


def parse_hostfile(path: str | Path) -> list[tuple[str, int]]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise HostfileError(f"{path}: cannot read the hostfile ({err.strerror})") from None
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if not match:
            raise HostfileError(f"{path} line {number}: expected '<hostname> slots=<ranks>', got {line!r}")
        host, slots = match["host"], int(match["slots"])
        if slots < 1:
            raise HostfileError(f"{path} line {number}: {host} has slots={slots}; a host needs at least one")
        if any(host == h for h, _ in hosts):
            raise HostfileError(f"{path} line {number}: {host} is listed twice")
        hosts.append((host, slots))
    if not hosts:
        raise HostfileError(f"{path}: no hosts (every line is blank or a comment)")
    return hosts


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m trainer.hostfile", description=__doc__.split("\n\n")[0])
    parser.add_argument("hostfile", type=existing_file)
    path = parser.parse_args(argv).hostfile
    try:
        hosts = parse_hostfile(path)
    except HostfileError as err:
        parser.error(str(err))
    print(
        f"{path}: {len(hosts)} host(s), {sum(s for _, s in hosts)} rank(s): " + ", ".join(f"{h}x{s}" for h, s in hosts)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
