"""What a config key is: its type's default, help, bound, and the rules beside it (``key``), for the settings."""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import field
from typing import Any, Literal

Bound = Literal["positive", "non-negative"]
# Which storage modes, backends and devices leave a data key unused: (cfg, effective StorageMode, backend, device type).
Unused = typing.Callable[[Any, str, str, str], bool]


def key(
    default: Any,
    help: str,
    *,
    bound: Bound | None = None,
    path: Literal["hdf5", "npy", "file"] | None = None,
    resumable: bool = False,
    tunable: bool = False,
    unused: Unused | None = None,
) -> Any:
    """A config key and what is known about it: its ``help``; the ``bound`` its value must respect (unless null);
    that it names a file (``path``: read with that data_format, or any file), so that ${VAR} in it is expanded; that
    a resumed run may change it without changing what it learns (``resumable``: where data and logs go, how fast
    the input pipeline runs, how often it logs and checks); that it says how the work is done, never what is
    computed, so that ``bench.tune`` may change it (``tunable``); and when the data path leaves it ``unused``."""
    metadata = {
        "help": help,
        "bound": bound,
        "path": path,
        "resumable": resumable,
        "tunable": tunable,
        "unused": unused,
    }
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)
