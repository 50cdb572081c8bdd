"""A recipe's nested dicts into checked dataclasses: every key and every value's type.

An unknown key or a value of the wrong type is a `ConfigError` naming the key and what is accepted
(with the closest valid key when there is one), before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

from polo.config.errors import ConfigError
from polo.core.registry import did_you_mean

# Keys polo no longer reads, and what a recipe naming one should say instead (one line, not "unknown key").
REMOVED_KEYS = {
    "output.tensorboard": "output.report_to replaced it: list the trackers, e.g. output.report_to=[tensorboard] "
    "(the default), or [] for none (metrics.jsonl is always written)",
}


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return `value` checked (and, where lossless, converted) against a type annotation."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value  # an entry's options: checked against its settings dataclass or signature when it is bound
    if origin in (Union, types.UnionType):
        return _coerce_union(value, annotation, key)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return _build(annotation, value, key)
    if origin is list:
        return _coerce_list(value, annotation, key)
    if origin is dict:
        return _coerce_dict(value, annotation, key)
    if annotation in _SCALARS:
        return _SCALARS[annotation](value, key)
    raise ConfigError(f"{key}: unsupported field type {_type_name(annotation)}")


def _coerce_union(value: Any, annotation: Any, key: str) -> Any:
    """Return `value` as the first option of a union annotation that accepts it (None for an optional's None)."""
    options = typing.get_args(annotation)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is type(None):
            continue
        try:
            return _coerce(value, option, key)
        except ConfigError:
            continue
    raise ConfigError(f"{key}: {value!r} is not a {_type_name(annotation)}")


def _coerce_list(value: Any, annotation: Any, key: str) -> list:
    """Return `value` as a list of the annotation's item type; a lone scalar is a list of one."""
    (item_type,) = typing.get_args(annotation)
    if isinstance(value, (str, int, float)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list, got {value!r}")
    return [_coerce(item, item_type, f"{key}[{index}]") for index, item in enumerate(value)]


def _coerce_dict(value: Any, annotation: Any, key: str) -> dict:
    """Return `value` as a mapping of string keys to the annotation's item type."""
    _, item_type = typing.get_args(annotation)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return {str(k): _coerce(v, item_type, f"{key}.{k}") for k, v in value.items()}


def _coerce_bool(value: Any, key: str) -> bool:
    """Return `value` when it is a bool: a YAML true/false, never a number or a string."""
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _coerce_int(value: Any, key: str) -> int:
    """Return `value` as an int: an int (not a bool), or a float with no fractional part."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def _coerce_float(value: Any, key: str) -> float:
    """Return `value` as a float: a number (not a bool), or a string that reads as one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # YAML reads "1e-6" as a string
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected a number, got {value!r}")


def _coerce_str(value: Any, key: str) -> str:
    """Return `value` as a string: a string, or a number (not a bool) written out."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {value!r}")


# The scalar field types and how a value is checked against each.
_SCALARS = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}


def _build(cls: type, values: dict, prefix: str = "", base: Any = None) -> Any:
    """Return `cls` built from `values` (over `base`, an instance holding the defaults, when given).

    A section is built over its field's own default instance, so a command's defaults for it
    (`polo dpo`'s learning rate, each command's output directory) hold for the keys a recipe leaves out.
    """
    hints = typing.get_type_hints(cls)
    specs = {spec.name: spec for spec in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if key in REMOVED_KEYS:
            raise ConfigError(f"{key} was removed; {REMOVED_KEYS[key]}")
        if name not in hints:
            raise ConfigError(
                f"unknown config key {key!r}{did_you_mean(str(name), specs)}; "
                f"valid keys{' in ' + prefix if prefix else ''}: {', '.join(specs)}"
            )
        factory = specs[name].default_factory
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, dict) and factory is not dataclasses.MISSING:
            kwargs[name] = _build(hints[name], value, key, base=factory())
        else:
            kwargs[name] = _coerce(value, hints[name], key)
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def build_dataclass(cls: type, data: dict, prefix: str = "") -> Any:
    """Return an instance of the dataclass `cls` built from nested dicts, every key and type checked (the keys named
    under `prefix` in errors)."""
    return _build(cls, data, prefix)
