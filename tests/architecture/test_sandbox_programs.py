"""The programs that run inside the sandbox are modules of polo, linted and tested like the rest, but
they run where only the standard library exists (docs/sandbox.md): they must import nothing else."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
# polo.sandbox.runner starts the first with `python -I -S -c`; polo.rewards.code sends the second as the program.
SANDBOX_PROGRAMS = ("polo/sandbox/child.py", "polo/rewards/harness.py")


def outside_the_standard_library(source: str) -> list[str]:
    """Return every import in `source` (inside functions too) of a module that is not in the standard library."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        else:
            continue
        found += [
            f"line {node.lineno}: {name}"
            for name in names
            if name.startswith(".") or name.partition(".")[0] not in sys.stdlib_module_names
        ]
    return found


@pytest.mark.parametrize("program", SANDBOX_PROGRAMS)
def test_sandbox_programs_import_only_the_standard_library(program):
    assert outside_the_standard_library((SRC / program).read_text()) == []


def test_the_import_check_finds_what_is_not_standard():
    source = "import os, json\nfrom __future__ import annotations\ndef f():\n    import torch\nfrom . import x\n"
    assert sorted(outside_the_standard_library(source)) == ["line 4: torch", "line 5: ."]
    assert outside_the_standard_library("from polo.sandbox import bwrap\n") == ["line 1: polo.sandbox"]
