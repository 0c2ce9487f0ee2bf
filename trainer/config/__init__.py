"""One typed experiment config: its settings (``settings``), how a config is loaded from the YAML file of named
configs and the command line (``loading``), and the command line itself (``command_line``)."""

from trainer.config.command_line import config_parser, parse_config_options
from trainer.config.loading import (
    DEFAULT_YAML,
    build_config,
    changes_on_resume,
    load_named,
    named_configs,
    parse_value,
    resumed_config,
    set_dotted,
)
from trainer.config.settings import (
    RECIPE,
    TUNABLE,
    Config,
    LRSchedule,
    WeightInit,
    channels_last_on,
    leaf_keys,
    to_dict,
)

__all__ = [
    "DEFAULT_YAML",
    "RECIPE",
    "TUNABLE",
    "Config",
    "LRSchedule",
    "WeightInit",
    "build_config",
    "changes_on_resume",
    "channels_last_on",
    "config_parser",
    "leaf_keys",
    "load_named",
    "named_configs",
    "parse_config_options",
    "parse_value",
    "resumed_config",
    "set_dotted",
    "to_dict",
]
