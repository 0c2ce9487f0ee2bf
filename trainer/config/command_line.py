"""The command line of every command that takes a config: each key an option (``--num_epochs 3``, dotted for nested
keys: ``--lr_schedule.start_lr 1e-3``), and a ``--help`` that gives each key's default, the chosen named config's
value, and the named configs."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from common.cli import ArgumentParser, existing_file
from trainer.config.loading import DEFAULT_YAML, build_config, load_named, named_configs
from trainer.config.settings import RENAMED, Config, leaf_keys, to_dict
from trainer.errors import ConfigError


def _plain(value: Any) -> Any:
    """A value as the YAML file holds it: dataclasses as mappings."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _as_yaml(value: Any) -> str:
    """A default as it would be written in the YAML file: null, [[1, 2, 3]], {scaling: sqrt, ...}."""
    value = _plain(value)
    return (
        yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6)
        .strip()
        .removesuffix("\n...")
        .strip()
    )


def _option_in(argv: Sequence[str], option: str) -> str | None:
    """The value the command line gives ``option``, read before parsing it (for --help)."""
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def configs_epilog(path: Path) -> str:
    """--help's closing list of the named configs, each with its description."""
    try:
        named = named_configs(path)
    except ConfigError as err:
        return f"named configs: {err}"
    width = max(len(name) for name, _ in named) if named else 0
    lines = [f"  {name:<{width}}  {description}".rstrip() for name, description in named]
    return f"named configs in {path} (--config NAME):\n" + "\n".join(lines)


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        out[prefix + key] = value
        if isinstance(value, dict) and key != "deepspeed_overrides":
            out |= _flat(value, prefix + key + ".")
    return out


def add_config_options(parser: argparse.ArgumentParser, yaml_path: Path, name: str) -> None:
    """Every config key as an option ``--key VALUE`` (dotted for nested keys), plus --config/--yaml_config. Each
    option's help gives the key's default, and the named config's value where that differs."""
    parser.add_argument("--config", default="debug", help="name of the config in --yaml_config (default: debug)")
    parser.add_argument(
        "--yaml_config",
        type=existing_file,
        default=DEFAULT_YAML,
        help=f"file of named configs (default: {DEFAULT_YAML})",
    )
    try:
        named = _flat(to_dict(build_config(load_named(yaml_path, name), {})))
    except ConfigError:
        named = {}  # a config that cannot be built says why when it is run, not in --help
    group = parser.add_argument_group(
        "config keys",
        f"override the named config; each key's default, and where the config '{name}' sets another value, that",
    )
    for key, (help_text, default) in leaf_keys(Config).items():
        values = f"default: {_as_yaml(default)}"
        if key in named and named[key] != _plain(default):
            values += f"; {name}: {_as_yaml(named[key])}"
        group.add_argument(
            f"--{key}",
            dest=f"set:{key}",
            metavar="VALUE",
            default=argparse.SUPPRESS,
            help=f"{help_text} ({values})".replace("%", "%%"),
        )


def config_parser(prog: str, description: str, argv: Sequence[str], *, usage: str | None = None) -> ArgumentParser:
    """A command's parser with the config options: one-line errors, the reference's renamed options hinted, each
    key's default and the chosen named config's value in --help, which closes with the named configs."""
    yaml_path = Path(_option_in(argv, "--yaml_config") or DEFAULT_YAML)
    parser = ArgumentParser(
        prog=prog,
        description=description,
        usage=usage,
        epilog=configs_epilog(yaml_path),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        renamed=RENAMED,
    )
    add_config_options(parser, yaml_path, _option_in(argv, "--config") or "debug")
    return parser


def parse_config_options(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, dict[str, str]]:
    """Parse; the config overrides apart (dotted key -> raw value)."""
    args = parser.parse_args(argv)
    overrides = {dest[4:]: value for dest, value in vars(args).items() if dest.startswith("set:")}
    return args, overrides
