"""Errors that any layer above the runtime may raise and the command line turns into one line."""

from __future__ import annotations

from polo.runtime.checkpoint import SaveError

__all__ = ["NonFiniteLossError", "SaveError"]

class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the update was not applied."""
