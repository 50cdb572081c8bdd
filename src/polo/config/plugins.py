"""Recipes that name a user's registered function: ``algorithm.advantage_estimator: my_module:centered``.

The part before ``:`` is a module polo imports (the current directory included, as `python -m`
would), so its ``@register_advantage("centered")`` decorator runs; the part after is the name it
registered. Built-in names need no module.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from polo.config.errors import ConfigError
from polo.core.registry import Registry


def import_user_module(module_name: str, key: str) -> ModuleType:
    """Return the imported module `module_name`, also found in the current directory; ConfigError naming `key` if
    absent."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # appended, so a user's file never shadows an installed package
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not (module_name == error.name or module_name.startswith(error.name + ".")):
            raise  # a missing dependency inside the user's module is their bug and keeps its traceback
        raise ConfigError(
            f"{key}: cannot import module {module_name!r} (looked in the current directory and on sys.path)"
        ) from error


def check_registered(key: str, value: str, registry: Registry) -> None:
    """Raise ConfigError unless `value` names a function in `registry`, importing its module first when it has one."""
    module_name, _, name = value.rpartition(":")
    if module_name:
        import_user_module(module_name, key)
        if name not in registry:
            raise ConfigError(
                f"{key}: module {module_name!r} registered no {registry.kind} named {name!r}; "
                f"registered: {', '.join(registry.names())}"
            )
    elif value not in registry:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(registry.names())} (or module:name for your own)")
