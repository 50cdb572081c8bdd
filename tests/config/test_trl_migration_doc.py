"""docs/migrating-from-trl.md names every field of TRL's GRPOConfig, and every polo key it maps one to exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from polo.config import Config
from polo.config.describe import sections

DOC = Path(__file__).parents[2] / "docs" / "migrating-from-trl.md"


def polo_keys() -> set[str]:
    return {key.key for section in sections(Config()) for key in section.keys}


def table_rows(text: str) -> list[tuple[str, str]]:
    """Return (GRPOConfig field, polo cell) of every mapping table row."""
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \|", text, flags=re.MULTILINE)
    return [(field, cell) for field, cell in rows]


def test_every_grpo_config_field_is_named():
    trl = pytest.importorskip("trl")
    text = DOC.read_text()
    fields = [field.name for field in dataclasses.fields(trl.GRPOConfig)]
    missing = [name for name in fields if f"`{name}`" not in text]
    assert not missing, f"docs/migrating-from-trl.md does not name these GRPOConfig fields: {missing}"
    assert f"has {len(fields)} fields" in text


def test_every_polo_key_in_the_tables_exists():
    rows = table_rows(DOC.read_text())
    assert len(rows) > 100
    keys = polo_keys()
    for field, cell in rows:
        named = re.findall(r"`([\w.]+)`", cell)
        assert cell == "none" or named, f"{field}: {cell!r} names no polo key"
        for key in named:
            assert key in keys, f"{field} maps to {key!r}, which is not a key of polo train"
