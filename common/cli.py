"""What every command shares on its command line: one-line errors, and paths checked for what they must be.

    parser = ArgumentParser(description="...")
    parser.add_argument("--input", type=existing_file)
    parser.add_argument("--out", type=output_dir)

A mistake on the command line is one line on stderr and exit status 2 (``prog: error: ...``), not the usage
block; an unknown option names the closest known one, or where a reference option went.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors and no abbreviated options.

    ``renamed`` maps options that other tools spell differently (the reference's ``--full_scale``) to a
    sentence saying what to use instead.
    """

    def __init__(self, *args: Any, renamed: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.renamed = dict(renamed or {})

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        argv = sys.argv[1:] if args is None else list(args)
        known = {flag for action in self._actions for flag in action.option_strings}
        for token in argv:  # an unknown option first: it often explains a missing required one
            if token == "--":
                break
            if token.startswith("--") and token.split("=", 1)[0] not in known:
                self.error(self.unknown_argument(token))
        parsed, unknown = self.parse_known_args(argv, namespace)
        if unknown:
            self.error(self.unknown_argument(unknown[0]))
        return parsed

    def unknown_argument(self, arg: str) -> str:
        if not arg.startswith("-"):
            return f"unexpected argument {arg!r}"
        flag = arg.lstrip("-").split("=", 1)[0]
        if flag in self.renamed:
            return f"unknown option --{flag}: {self.renamed[flag]}"
        known = [a.lstrip("-") for action in self._actions for a in action.option_strings]
        close = difflib.get_close_matches(flag, known, n=1)
        return f"unknown option --{flag}" + (f" (did you mean --{close[0]}?)" if close else " (--help lists them)")


def existing_file(text: str) -> Path:
    """A file that must exist (data, weights, configs)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory, not a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file {path}")
    return path


def existing_dir(text: str) -> Path:
    """A directory that must exist (a run directory to read)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{path} is a file, not a directory" if path.exists() else f"no such directory {path}"
        )
    return path


def output_file(text: str) -> Path:
    """A file to write: it may exist (the command decides whether to replace it) but not as a directory, and the
    directory it goes into may be created but not be a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; name the file to write")
    _check_parents(path)
    return path


def output_dir(text: str) -> Path:
    """A directory to write into: it may exist, as a directory, or be created."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file, not a directory")
    _check_parents(path)
    return path


def parent_problem(path: Path) -> str | None:
    """Why ``path`` cannot be created (the nearest existing directory above it is a file), or None."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else f"{path}: {parent} is a file, not a directory"
    return None


def _check_parents(path: Path) -> None:
    if problem := parent_problem(path):
        raise argparse.ArgumentTypeError(problem)
