"""A settings field that documents itself: `setting(default, help=..., range=..., choices=...)`.

It lives in `polo.core` so that a part registered here (a policy loss with options of its own) declares
its settings dataclass the way every recipe section does; `polo.config.fields` says what each piece of
metadata means and holds the checks that read it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import MISSING
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
