"""Run configuration: schema dataclasses, algorithm presets, YAML recipes and overrides."""

from polo.config.loading import apply_overrides, build_dataclass, config_to_dict, load_config, read_recipe
from polo.config.presets import PRESETS, apply_preset
from polo.config.schema import (
    AlgorithmConfig,
    Config,
    ConfigError,
    EvalConfig,
    LoraSettings,
    ModelConfig,
    OutputConfig,
    SamplingConfig,
    TaskConfig,
    TrainConfig,
)
from polo.config.validation import check_at_least_one, check_choices, check_lora, validate

__all__ = [
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "LoraSettings",
    "ModelConfig",
    "OutputConfig",
    "PRESETS",
    "SamplingConfig",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "apply_preset",
    "build_dataclass",
    "check_at_least_one",
    "check_choices",
    "check_lora",
    "config_to_dict",
    "load_config",
    "read_recipe",
    "validate",
]
