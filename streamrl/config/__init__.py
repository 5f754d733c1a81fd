"""The typed run configuration: one schema of msgspec Structs, loaded from YAML plus `--set` overrides.

The package owns the schema (`schema.py`: every field has a default, a type, its constraints and a
one-line doc, so `describe_config()` in `fields.py` can list them), loading (`loading.py`), the
cross-field rules (`validate.py`), and turning every mistake into one `ConfigError` line that names
the dotted key. It knows nothing about torch, engines or trainers: components read their section;
they are never imported here.
"""

from .fields import describe_config
from .loading import config_from_dict, dump_config, load_config
from .schema import (
    DATA_SUFFIXES,
    KNOWN_TASKS,
    BufferConfig,
    Config,
    ConfigError,
    ControllerConfig,
    DataConfig,
    EnginesConfig,
    JudgeConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    ScheduleConfig,
    ToolsConfig,
    TrainerConfig,
    VerifiersConfig,
    WarmStartConfig,
)
from .validate import validate

__all__ = [
    "DATA_SUFFIXES", "KNOWN_TASKS", "BufferConfig", "Config", "ConfigError", "ControllerConfig", "DataConfig",
    "EnginesConfig", "JudgeConfig", "LoggingConfig", "ModelConfig", "RolloutConfig", "ScheduleConfig", "ToolsConfig",
    "TrainerConfig", "VerifiersConfig", "WarmStartConfig", "config_from_dict",
    "describe_config", "dump_config", "load_config", "validate",
]
