"""Run configuration: schema dataclasses whose fields document themselves, presets, YAML recipes and overrides."""

from polo.config.errors import ConfigError
from polo.config.fields import setting
from polo.config.loading import apply_overrides, build_dataclass, config_to_dict, load_config, read_recipe
from polo.config.presets import PRESETS, apply_preset
from polo.config.schema import (
    AlgorithmConfig,
    Config,
    EvalConfig,
    LoraSettings,
    ModelConfig,
    OptimizerConfig,
    OutputConfig,
    SamplingConfig,
    TaskConfig,
    TrainConfig,
)
from polo.config.validation import check_lora, check_settings, validate

__all__ = [
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "LoraSettings",
    "ModelConfig",
    "OptimizerConfig",
    "OutputConfig",
    "PRESETS",
    "SamplingConfig",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "apply_preset",
    "build_dataclass",
    "check_lora",
    "check_settings",
    "config_to_dict",
    "load_config",
    "read_recipe",
    "setting",
    "validate",
]
