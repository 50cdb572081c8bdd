"""A config field that documents itself: `setting(default, help=..., range=..., choices=...)`.

Every field of every recipe section (`polo train`, `sft`, `rm`, `dpo`, `control`, `pipeline`) is
declared with `setting` (defined in `polo.core.fields`, so that a part registered in `polo.core` declares its
options the same way), so its metadata is the one source of three things: the range and choices
checks (`polo.config.validation.check_settings`), `polo config` and `polo train --help KEY`, and
docs/config.md (`polo.config.describe`). A field without help fails tests/config/test_documented.py.

    help     what the field does, and the paper it comes from where there is one
    range    numbers: "> 0", ">= 0", or an interval such as "[0, 1)"; every float must also be
             finite, and a list of numbers is checked item by item
    choices  strings (or each string of a list): a tuple of names, or a `polo.core.Registry`,
             whose registered names are accepted, and module:name for a user's own
    others   the other forms a value may take beside the choices ("a local model directory"): the
             choices are then shown, not enforced, and the value is checked where it is used
    options_of  a mapping of options for the entry a sibling key names in this `Registry`: each
             entry's settings dataclass is shown by `polo config` as a section under this key
    used_by  a `Registry` of builders (tasks): the key is shown with the entries whose builder takes
             a parameter of its name, so its help never lists them by hand
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from polo.core.fields import Choices, parse_range, setting
from polo.core.registry import Registry

__all__ = ["Choices", "accepted", "choice_names", "help_of", "override", "parse_range", "setting", "within"]


def override(cls: type, name: str, default: Any, *, help: str | None = None, range: str | None = None) -> Any:
    """Return field `name` of the dataclass `cls` with another default (and help or range): a subclass's own default."""
    (spec,) = [spec for spec in fields(cls) if spec.name == name]
    metadata = dict(spec.metadata)
    metadata.update({key: value for key, value in (("help", help), ("range", range)) if value is not None})
    return setting(default, **metadata)


def within(spec: str | None, value: float) -> bool:
    """Return True when `value` is finite and inside the range `spec` (None: any finite number)."""
    if not math.isfinite(value):
        return False
    if spec is None:
        return True
    low, high, low_in, high_in = parse_range(spec)
    above = value >= low if low_in else value > low
    return above and (value <= high if high_in else value < high)


def accepted(spec: str | None, integer: bool = False) -> str:
    """Return what a value must be, ending "KEY must be ...": "at least 1", "in [0, 1)", "a finite number > 0"."""
    if spec is None:
        return "a finite number"
    if spec.strip()[0] in "[(":
        return f"in {spec.strip()}"
    low, _, low_in, _ = parse_range(spec)
    if integer:
        return f"at least {int(low) if low_in else int(low) + 1}"
    return f"a finite number {spec.strip()}"


def choice_names(choices: Choices) -> list[str]:
    """Return the accepted names of `choices`: a registry's names in registration order, YAML's true/false for
    bools."""
    if isinstance(choices, Registry):
        return choices.names()
    return [str(choice).lower() if isinstance(choice, bool) else str(choice) for choice in choices]


def help_of(cls: type, name: str) -> str:
    """Return the help of field `name` of the dataclass `cls` ("" when it has none)."""
    (spec,) = [spec for spec in fields(cls) if spec.name == name]
    return spec.metadata.get("help", "")
