"""YAML recipes and `dotted.key=value` overrides into checked dataclasses (`polo.config.building` checks each key)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from polo.config.building import _build, build_dataclass
from polo.config.errors import ConfigError
from polo.config.presets import apply_preset
from polo.config.schema import Config
from polo.config.validation import validate

__all__ = ["apply_overrides", "build_dataclass", "config_to_dict", "load_config", "read_recipe"]


def config_to_dict(config: Config) -> dict:
    """Return the configuration as plain nested dicts (for YAML, JSON and TensorBoard)."""
    return dataclasses.asdict(config)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return `data` with each `dotted.key=value` override set (values parsed as YAML scalars)."""
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} is not of the form dotted.key=value")
        dotted, raw = override.split("=", 1)
        parts = dotted.strip().split(".")
        if parts[0] == "rewards" and len(parts) > 2:
            # reward names may be import paths with dots: rewards.my_pkg.scoring:fn=0.5
            parts = ["rewards", ".".join(parts[1:])]
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return data


def read_recipe(recipe: str | Path | dict | None, overrides: list[str] | None = None) -> dict:
    """Return a recipe (YAML path, mapping or None) as a plain dict with the overrides applied."""
    if recipe is None:
        data: dict = {}
    elif isinstance(recipe, dict):
        data = dict(recipe)
    else:
        path = Path(recipe)
        if not path.exists():
            raise FileNotFoundError(f"recipe {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"recipe {path} is not valid YAML: {error}") from error
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return apply_overrides(data, overrides or [])


def load_config(recipe: str | Path | dict | None = None, overrides: list[str] | None = None) -> Config:
    """Return a validated `Config` from a recipe (path or mapping) plus dotted overrides."""
    config = _build(Config, apply_preset(read_recipe(recipe, overrides)))
    validate(config)
    return config
