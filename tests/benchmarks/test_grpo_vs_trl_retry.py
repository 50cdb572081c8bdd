"""benchmarks/grpo_vs_trl.py: a run redone because other processes used the CPU starts from an empty directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def grpo_vs_trl(load_benchmark):
    return load_benchmark("grpo_vs_trl")


def test_a_retried_run_finds_no_earlier_attempt_in_its_directory(grpo_vs_trl, tmp_path, monkeypatch):
    out_dir = tmp_path / "round1-polo"
    seen = []

    def child(command, stdout, stderr):
        out = Path(command[command.index("--out") + 1])
        seen.append(sorted(path.name for path in out.iterdir()))
        (out / "run").mkdir()  # what a polo run leaves: a retry in place would find it and refuse
        (out / "result.json").write_text(json.dumps({"step_times": [1.0, 2.0], "foreign_cores": 0.0}))
        return 0

    monkeypatch.setattr(grpo_vs_trl.subprocess, "call", child)
    for _ in range(2):
        result = grpo_vs_trl.run_child("polo", 2, out_dir)
    assert seen == [["child.log"], ["child.log"]]  # the second attempt saw only its own log, not the first's run
    assert result["step_times"] == [1.0, 2.0]
