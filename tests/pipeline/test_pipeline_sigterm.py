"""`polo pipeline` stopped by SIGTERM in the middle of a grpo stage, then run again: the result of a straight run.

The pipeline runs as the real `polo` executable; `tests/signal_hook/sitecustomize.py` (prepended to
PYTHONPATH) makes it send itself SIGTERM during an update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file
from tiny_pipeline import tiny_grpo, tiny_pipeline

from polo.pipeline import run_pipeline
from polo.runtime.interrupt import EXIT_STOPPED
from polo.runtime.run_lock import LOCK_FILE

POLO = Path(sys.executable).with_name("polo")
HOOK = Path(__file__).resolve().parents[1] / "signal_hook"


def two_stage_recipe(model_dir: Path, root: Path) -> dict:
    """The cold-start SFT stage, then a 3-step grpo stage, without the starting model's evaluation."""
    recipe = tiny_pipeline(model_dir, root)
    recipe["stages"] = {"cold_start": recipe["stages"]["cold_start"], "reason": tiny_grpo(3)}
    recipe["eval"] = {**recipe["eval"], "base": False}
    return recipe


def polo_pipeline(path: Path, **variables: str) -> subprocess.CompletedProcess:
    """Run `polo pipeline path` with the test hook prepended to PYTHONPATH and `variables` set."""
    env = {**os.environ, **variables}
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([str(POLO), "pipeline", str(path)], env=env, capture_output=True, text=True, timeout=900)


def grpo_steps(stage_dir: Path) -> list[int]:
    """Return the steps of the training rows in a grpo stage's metrics.jsonl, in order."""
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if "reward/mean" in row]


def test_sigterm_mid_stage_then_the_same_command_finishes_as_an_uninterrupted_pipeline(tiny_model_dir, tmp_path):
    run_pipeline(two_stage_recipe(tiny_model_dir, tmp_path / "straight"))
    root = tmp_path / "stopped"
    path = tmp_path / "r1.yaml"
    path.write_text(yaml.safe_dump(two_stage_recipe(tiny_model_dir, root)))

    stopped = polo_pipeline(path, POLO_TEST_SIGTERM="update:2")  # the grpo stage's step 2
    checkpoint = root / "b_reason" / "checkpoints" / "step-000002"
    assert stopped.returncode == EXIT_STOPPED, stopped.stdout + stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"polo: stopped by SIGTERM in stage b_reason after step 2; saved {checkpoint}; "
        f"resume with: polo pipeline {path}"
    ), stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert (root / "a_cold_start" / "stage_done.json").exists() and not (root / "b_reason" / "stage_done.json").exists()
    assert not (root / LOCK_FILE).exists() and not (root / "b_reason" / LOCK_FILE).exists()

    again = polo_pipeline(path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "stage a_cold_start (sft) already done" in again.stdout and "(continuing)" in again.stdout
    assert grpo_steps(root / "b_reason") == [1, 2, 3]  # contiguous, no step twice
    final = "b_reason/checkpoints/step-000003/model.safetensors"
    a, b = load_file(str(tmp_path / "straight" / final)), load_file(str(root / final))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
