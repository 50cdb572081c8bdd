"""Errors that any layer above the runtime may raise and the command line turns into one line."""

from __future__ import annotations

from polo.runtime.checkpoint import OutputDirInUseError, SaveError

__all__ = ["DivergenceError", "NonFiniteLossError", "OutputDirInUseError", "SaveError"]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the update was not applied."""


class DivergenceError(NonFiniteLossError):
    """A step's weights (or, when judged, its loss or gradient norm) jumped or stopped being finite.

    A subclass of `NonFiniteLossError` so that every caller that reports that one in a line reports
    this one too; the run stopped before the step's weights were saved anywhere.
    """
