"""Check, in seconds and before anything runs, that this Python has every module the project needs.

    python -m tools.preflight            # exit 2, naming every missing module (or one too old to work)
    python -m tools.preflight --dali     # NVIDIA DALI and its requirements too

The modules are those tools/offline_wheels.sh ships (tools/offline_packages.txt), plus torch with CUDA where
``--gpu``. Without this, a missing module surfaces late and in disguise (a missing einops reads as "FusedAdam
did not build"). A package older than this project's pin is named on a second line but passes, except where an
older one is known not to work (``MINIMUMS``). Standard library only: it must run where those packages are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent
PACKAGES = REPO / "tools" / "offline_packages.txt"
# Older than these, the package is known to break the project: pydantic 2.14 (DeepSpeed's config) needs
# typing-extensions 4.16, DeepSpeed 0.19 needs pydantic 2.
MINIMUMS = {"typing_extensions": "4.16", "pydantic": "2.0"}


def listed(*, dali: bool) -> list[tuple[str, str]]:
    """(distribution, module) pairs of tools/offline_packages.txt; the [dali] section with ``dali``."""
    pairs, section = [], "base"
    for raw in PACKAGES.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line == "[dali]":
            section = "dali"
        elif line and (section == "base" or dali):
            distribution, module = line.split()
            pairs.append((distribution, module))
    if dali:
        pairs.append(("nvidia-dali-cuda120", "nvidia.dali"))
    return pairs


def pinned(distribution: str) -> str | None:
    """The version constraints.txt or requirements.txt pins, if any."""
    wanted = re.sub(r"[-_.]+", "-", distribution).lower()
    for name in ("constraints.txt", "requirements.txt", "requirements-dev.txt"):
        for line in (REPO / name).read_text().splitlines():
            pin = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line.strip())
            if pin and re.sub(r"[-_.]+", "-", pin.group(1)).lower() == wanted:
                return pin.group(2)
    return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def problems(*, dali: bool, gpu: bool) -> tuple[list[str], list[str]]:
    """(what stops the project: missing modules, versions below MINIMUMS; packages older than their pins)."""
    found, older = [], []
    for distribution, module in listed(dali=dali):
        try:
            present = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            present = False
        if not present:
            found.append(f"{module} (pip: {distribution})")
            continue
        try:
            have = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue  # importable without metadata (a source tree on PYTHONPATH): nothing to compare
        if distribution in MINIMUMS and _release(have) < _release(MINIMUMS[distribution]):
            found.append(
                f"{module} {have} is older than the {MINIMUMS[distribution]} the project needs ({distribution})"
            )
        elif (want := pinned(distribution)) and _release(have) < _release(want):
            older.append(f"{distribution} {have} (pinned: {want})")
    if importlib.util.find_spec("torch") is None:
        found.append("torch")
    elif gpu:
        import torch

        if not torch.cuda.is_available():
            found.append(f"a CUDA device for torch {torch.__version__} (CUDA {torch.version.cuda})")
    return found, older


class _OneLineErrors(argparse.ArgumentParser):
    """A mistake on the command line is one line (common.cli's parser would import the project's packages)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineErrors(prog="python -m tools.preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dali", action="store_true", help="check NVIDIA DALI and its requirements too")
    parser.add_argument("--gpu", action="store_true", help="check that torch sees a CUDA device")
    args = parser.parse_args(argv)
    found, older = problems(dali=args.dali, gpu=args.gpu)
    if older:
        print(f"preflight: older than this project's pins (tested with those): {', '.join(older)}")
    if found:
        print(f"preflight: missing or too old in {sys.executable}: " + "; ".join(found), file=sys.stderr)
        return 2
    print(f"preflight: every module is here ({sys.executable})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
