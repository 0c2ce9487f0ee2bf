"""Loading a config strictly: defaults < named config in the YAML file < command-line overrides.

Named configs live in a YAML file (``ds_configs/UNet.yaml``), one mapping per name, with YAML anchors for inheritance
as in the reference. Unknown keys (with the closest known key suggested) and values of the wrong type are errors
that name the key; ``${VAR}`` in file keys is taken from the environment; a resumed run's config is its recorded one
with the overrides that do not change what it learns.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from common.cli import parent_problem
from trainer.config.settings import PATH_KEYS, RENAMED, RESUMABLE, Config, to_dict
from trainer.errors import ConfigError

DEFAULT_YAML = Path("ds_configs/UNet.yaml")
log = logging.getLogger(__name__)


def _unknown_key(key: str, known: list[str], where: str) -> ConfigError:
    if key in RENAMED:
        return ConfigError(f"unknown key '{where}{key}': {RENAMED[key]}")
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{where}{close[0]}'?)" if close else ""
    return ConfigError(f"unknown key '{where}{key}'{hint}")


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML reads it, except that 5e8 and 1e-3 (exponent, no dot) are numbers, as in YAML 1.2 and
    JSON, not strings; quoted, they stay strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def _convert(value: Any, hint: Any, key: str) -> Any:
    """``value`` as type ``hint``, or ConfigError naming ``key``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _convert(value, inner, key)
    if origin is Literal:
        if isinstance(value, bool) or value not in typing.get_args(hint):
            hint_bool = " (YAML reads yes/no/on/off as booleans: quote the value)" if isinstance(value, bool) else ""
            raise ConfigError(f"{key} must be one of {list(typing.get_args(hint))}, got {value!r}{hint_bool}")
        return value
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return from_dict(hint, value, prefix=f"{key}.")
    if hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, hint):
        return value
    raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, strictly; missing keys take the defaults."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise _unknown_key(key, known, prefix)
    return cls(**{key: _convert(value, hints[key], prefix + key) for key, value in data.items()})


def named_configs(path: Path) -> list[tuple[str, str]]:
    """(name, description) of every named config in the YAML file ``path``; ConfigError if it cannot be read."""
    document = _named_document(path)
    return [
        (name, str(body.get("description", "")) if isinstance(body, dict) else "") for name, body in document.items()
    ]


def _named_document(path: Path) -> dict[str, Any]:
    """The YAML file of named configs at ``path``, anchors resolved; ConfigError if it cannot be read."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    try:
        document = yaml.load(text, _Loader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path} must map config names to configs")
    return document


def load_named(path: Path, name: str) -> dict[str, Any]:
    """The mapping named ``name`` in the YAML file ``path`` (YAML anchors resolved)."""
    document = _named_document(path)
    if name not in document:
        raise ConfigError(f"no config named '{name}' in {path} (available: {', '.join(sorted(document))})")
    selected = document[name]
    if not isinstance(selected, dict):
        raise ConfigError(f"config '{name}' in {path} is not a mapping")
    return dict(selected)


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, creating (or replacing a null with) intermediate mappings."""
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value


def parse_value(raw: str) -> Any:
    """A command-line value as YAML would read it (3 -> int, 1e-3 -> float, null -> None, [1, 2] -> list)."""
    try:
        return yaml.load(raw, _Loader)
    except yaml.YAMLError:
        return raw


_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def expand_path(key: str, value: str, environ: Mapping[str, str] = os.environ) -> str:
    def replace(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is None:
            raise ConfigError(
                f"{key} refers to ${{{name}}}, which is not set (write ${{{name}:-default}} for a default)"
            )
        return default

    return _VARIABLE.sub(replace, value)


def build_config(base: dict[str, Any], overrides: dict[str, str]) -> Config:
    """The config from a named mapping plus command-line ``overrides`` (dotted key -> raw string)."""
    data = copy.deepcopy(base)
    for key, raw in overrides.items():
        set_dotted(data, key, parse_value(raw))
    cfg = from_dict(Config, data)
    for key in PATH_KEYS:
        setattr(cfg, key, expand_path(key, getattr(cfg, key)))
    cfg.validate()
    kinds = {f.name: f.metadata["path"] for f in dataclasses.fields(Config)}
    for key in (k for k in PATH_KEYS if kinds[k] in (cfg.data_format, "file")):
        path = Path(getattr(cfg, key))
        if path.is_dir():
            raise ConfigError(f"{key} {path} is a directory, not a file")
        if problem := parent_problem(path):
            raise ConfigError(f"{key} {problem}")
    return cfg


def _with_defaults(saved: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with the keys it lacks (added to the config since) at their defaults, in sections too."""
    merged = dict(saved)
    for key, default in defaults.items():
        if key not in merged:
            merged[key] = default
        elif isinstance(default, dict) and default and isinstance(merged[key], dict):
            merged[key] = _with_defaults(merged[key], default)
    return merged


def changes_on_resume(saved: dict[str, Any], cfg: Config) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(harmless, training-changing) differences between a run's saved config and the resumed one."""
    now = _with_defaults(saved, to_dict(Config()))  # keys newer than the saved run: it ran with their defaults
    changed = {k: (now[k], v) for k, v in to_dict(cfg).items() if now[k] != v}
    harmless = {k: d for k, d in changed.items() if k in RESUMABLE}
    return harmless, {k: d for k, d in changed.items() if k not in RESUMABLE}


def resumed_config(saved: dict[str, Any], overrides: dict[str, str], *, allow_change: bool) -> tuple[str, Config]:
    """The name and config of a run to resume, from what it recorded (``saved``) with ``overrides`` on top: settings
    that change the training are refused unless ``allow_change``; every change is logged."""
    cfg = build_config(saved["config"], overrides)
    harmless, changing = changes_on_resume(saved["config"], cfg)

    def listing(diff: dict[str, tuple]) -> str:
        return ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items())

    if changing and not allow_change:
        raise ConfigError(
            f"resuming with settings that change the training: {listing(changing)} (--allow_config_change accepts them)"
        )
    if harmless or changing:
        log.warning("resuming with changed settings: %s", listing({**harmless, **changing}))
    return saved["name"], cfg
