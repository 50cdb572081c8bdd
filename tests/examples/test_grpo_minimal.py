"""examples/grpo_minimal.py runs end to end: a few GRPO steps on the tiny test model, and a clear exit without a model."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_minimal.py"
ACCURACY_LINE = re.compile(r"^greedy accuracy on 2 held-out problems: (\S+) before -> (\S+) after$")


def run_example(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300, env=env)


def parse_step_line(line: str) -> dict[str, str]:
    """'step   1 | reward 0.125 | ... | kl - | 0.3 s' -> {'step': '1', 'reward': '0.125', ..., 'seconds': '0.3'}."""
    *named, seconds = [part.strip() for part in line.split("|")]
    fields = dict(part.split(maxsplit=1) for part in named)
    value, unit = seconds.split()
    assert unit == "s", line
    return {**fields, "seconds": value}


@pytest.mark.parametrize(
    "extra",
    [[], ["--beta", "0.1", "--update-epochs", "2", "--micro-batch-size", "3"]],
    ids=["grpo", "kl-and-two-epochs"],
)
def test_two_steps_on_the_tiny_model(tiny_model_dir: Path, extra: list[str]) -> None:
    result = run_example(
        "--model",
        str(tiny_model_dir),
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--num-eval",
        "2",
        *extra,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()

    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 2, result.stdout
    for expected_step, line in enumerate(step_lines, start=1):
        fields = parse_step_line(line)
        assert int(fields.pop("step")) == expected_step
        kl = fields.pop("kl")
        if "--beta" in extra:
            fields["kl"] = kl
        else:
            assert kl == "-", line  # no reference model, so no KL to report
        assert set(fields) >= {"reward", "accuracy", "length", "loss", "seconds"}, line
        for name, text in fields.items():
            assert math.isfinite(float(text)), f"{name} is not a finite number in {line!r}"
        assert 0.0 <= float(fields["reward"]) <= 1.0 and 0.0 <= float(fields["accuracy"]) <= 1.0
        assert 1.0 <= float(fields["length"]) <= 8.0

    match = ACCURACY_LINE.match(lines[-1])
    assert match, result.stdout
    assert all(0.0 <= float(value) <= 1.0 for value in match.groups())


def test_missing_default_model_exits_2_with_one_line(tmp_path: Path) -> None:
    # An empty POLO_CACHE is a fresh machine where `make model` has not run yet.
    result = run_example("--steps", "1", env={**os.environ, "POLO_CACHE": str(tmp_path)})
    assert result.returncode == 2
    output = (result.stdout + result.stderr).strip().splitlines()
    assert len(output) == 1, output
    assert "make model" in output[0] and str(tmp_path) in output[0]
