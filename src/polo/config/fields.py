"""A config field that documents itself: `setting(default, help=..., range=..., choices=...)`.

Every field of every recipe section (`polo train`, `sft`, `rm`, `dpo`, `control`, `pipeline`) is
declared with `setting`, so its metadata is the one source of three things: the range and choices
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

import copy
import math
from dataclasses import MISSING, fields
from dataclasses import field as dataclass_field
from typing import Any

from polo.core.registry import Registry

Choices = tuple[str, ...] | Registry


def setting(
    default: Any = MISSING,
    *,
    help: str,
    range: str | None = None,
    choices: Choices | None = None,
    others: str | None = None,
    options_of: Registry | None = None,
    used_by: Registry | None = None,
    default_factory: Any = MISSING,
) -> Any:
    """Return a dataclass field whose metadata holds its help, range and choices (list and dict defaults are copied)."""
    if range is not None:
        parse_range(range)  # a malformed range fails when polo is imported, not when a value is checked
    if isinstance(default, (list, dict)):
        default, default_factory = MISSING, (lambda value=default: copy.deepcopy(value))
    metadata = {
        "help": help,
        "range": range,
        "choices": choices,
        "others": others,
        "options_of": options_of,
        "used_by": used_by,
    }
    return dataclass_field(default=default, default_factory=default_factory, metadata=metadata)


def override(cls: type, name: str, default: Any, *, help: str | None = None, range: str | None = None) -> Any:
    """Return field `name` of the dataclass `cls` with another default (and help or range): a subclass's own default."""
    (spec,) = [spec for spec in fields(cls) if spec.name == name]
    metadata = dict(spec.metadata)
    metadata.update({key: value for key, value in (("help", help), ("range", range)) if value is not None})
    return setting(default, **metadata)


def parse_range(spec: str) -> tuple[float, float, bool, bool]:
    """Return (low, high, low included, high included) of a range: "> 0", ">= 0", "[0, 1)", "(0, 1]"."""
    text = spec.strip()
    if text[:1] in "[(" and text[-1:] in "])":
        low, high = (float(bound) for bound in text[1:-1].split(","))
        return low, high, text[0] == "[", text[-1] == "]"
    operator, _, bound = text.partition(" ")
    if operator not in (">", ">="):
        raise ValueError(f"range {spec!r} is not '> N', '>= N' or an interval such as '[0, 1)'")
    return float(bound), math.inf, operator == ">=", False


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
