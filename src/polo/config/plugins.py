"""Recipes that name a registered part, or a user's own as ``module:name``: ``algorithm.policy_loss: my_losses:cispo``.

The part before ``:`` is a module polo imports (the current directory included, as `python -m`
would), so its ``@register_policy_loss("cispo")`` decorator runs; the part after is the name it
registered, or, for a registry that takes any attribute (tasks, rewards), the attribute itself.
Built-in names need no module. Every failure is one `ConfigError` line naming the key.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from polo.config.errors import ConfigError
from polo.core.registry import Registered, Registry, did_you_mean


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


def resolve(key: str, value: str, registry: Registry) -> Registered:
    """Return the entry `value` names in `registry`: a registered name, or module:name with the module imported.

    In a registry that takes attributes (`Registry.by_attribute`) the module's attribute wins over a
    registered name (a user's `my_rewards:correct` is theirs, not the built-in); an attribute that
    the module also registered keeps its registration (its settings).
    """
    module_name, _, name = value.rpartition(":")
    if not module_name:
        if value in registry:
            return registry.entry(value)
        raise ConfigError(f"{key}: {registry.unknown(value)}")
    if not registry.user_entries:
        raise ConfigError(f"{key}: {value!r} names a module, but a {registry.kind} is one of {', '.join(registry)}")
    module = import_user_module(module_name, key)
    if registry.by_attribute and hasattr(module, name):
        attribute = getattr(module, name)
        registered = [entry for entry in registry.entries() if entry.value is attribute]
        return registered[0] if registered else Registered(value, attribute)
    if name in registry:
        return registry.entry(name)
    if registry.by_attribute:
        public = [attribute for attribute in vars(module) if not attribute.startswith("_")]
        raise ConfigError(f"{key}: module {module_name!r} has no attribute {name!r}{did_you_mean(name, public)}")
    raise ConfigError(
        f"{key}: module {module_name!r} registered no {registry.kind} named {name!r}"
        f"{did_you_mean(name, registry.names())}; registered: {', '.join(registry)}"
    )


def check_registered(key: str, value: str, registry: Registry) -> None:
    """Raise ConfigError unless `value` names an entry of `registry`, importing its module first when it has one."""
    resolve(key, value, registry)
