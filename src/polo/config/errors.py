"""The one error a recipe or override can raise: `ConfigError`, a single line naming the key and what is accepted."""

from __future__ import annotations


class ConfigError(ValueError):
    """A recipe or override that does not fit the configuration schema."""
