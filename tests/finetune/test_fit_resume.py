"""`polo sft` and `polo dpo` stopped by SIGTERM mid-run, then resumed with the command the stop line gives, and
`polo sft` killed by SIGKILL mid-run, then resumed: the final weights are those of an uninterrupted run, bit for bit.

The runs are the real `polo` executable; `tests/signal_hook/sitecustomize.py` (prepended to PYTHONPATH) makes
one send itself SIGTERM or SIGKILL in the backward pass of an optimizer step, so where it stops never depends
on timing.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file
from test_dpo import rankings_file
from test_sft import tiny_recipe

from polo.finetune.dpo import dpo
from polo.finetune.sft import sft
from polo.runtime.interrupt import EXIT_STOPPED
from polo.runtime.metrics import read_metrics
from polo.runtime.run_lock import LOCK_FILE

POLO = Path(sys.executable).with_name("polo")
HOOK = Path(__file__).resolve().parents[1] / "signal_hook"


def polo(*words: str, **variables: str) -> subprocess.CompletedProcess:
    """Run `polo words...` with the test hook prepended to PYTHONPATH and `variables` set."""
    env = {**os.environ, **variables}
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([str(POLO), *words], env=env, capture_output=True, text=True, timeout=900)


def stop_then_resume(command: str, recipe: dict, tmp_path: Path, step: int) -> Path:
    """Run `polo COMMAND` on `recipe` with SIGTERM in step `step`, check the stop, resume it; return its dir."""
    path = tmp_path / f"{command}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = Path(recipe["output"]["dir"])
    stopped = polo(command, str(path), POLO_TEST_SIGTERM=f"fit:{step}")
    assert stopped.returncode == EXIT_STOPPED, stopped.stdout + stopped.stderr
    checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
    last_line = stopped.stderr.strip().splitlines()[-1]
    assert last_line == (
        f"polo: stopped by SIGTERM after step {step}; saved {checkpoint}; resume with: polo {command} {path} "
        "output.resume=true"
    ), stopped.stderr
    assert "Traceback" not in stopped.stderr and not (run_dir / "final").exists()
    assert not (run_dir / LOCK_FILE).exists()
    again = polo(*shlex.split(last_line.partition("resume with: polo ")[2]))
    assert again.returncode == 0, again.stdout + again.stderr
    return run_dir


def same_weights(first: Path, second: Path) -> bool:
    a, b = load_file(str(first / "final" / "model.safetensors")), load_file(str(second / "final" / "model.safetensors"))
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def training_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row]


def test_sigterm_mid_sft_then_resume_gives_the_weights_of_an_uninterrupted_run(tiny_model_dir, tmp_path):
    straight = tiny_recipe(tiny_model_dir, tmp_path, train={"max_steps": 5, "eval_every": 2})
    sft(straight)
    resumed = dict(straight, output={**straight["output"], "dir": str(tmp_path / "stopped")})
    run_dir = stop_then_resume("sft", resumed, tmp_path, step=3)
    assert training_steps(run_dir) == [1, 2, 3, 4, 5]  # contiguous, no step twice
    assert same_weights(tmp_path / "run", run_dir)
    assert (
        read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["eval/loss"]
        == (read_metrics(run_dir / "metrics.jsonl")[-1]["eval/loss"])
    )


def test_sigterm_mid_dpo_then_resume_gives_the_weights_of_an_uninterrupted_run(tiny_model_dir, tmp_path):
    straight = {
        "model": {"name": str(tiny_model_dir)},
        "data": {
            "train_path": rankings_file(tmp_path / "train.jsonl", 8),
            "eval_path": rankings_file(tmp_path / "eval.jsonl", 4),
        },
        "dpo": {"beta": 0.5},
        "train": {"epochs": 2, "batch_size": 3, "micro_batch_size": 4, "learning_rate": 3e-3, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "run"), "report_to": [], "progress": False},
    }
    dpo(straight)
    resumed = dict(straight, output={**straight["output"], "dir": str(tmp_path / "stopped")})
    run_dir = stop_then_resume("dpo", resumed, tmp_path, step=4)  # in the second epoch's shuffle
    assert training_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert same_weights(tmp_path / "run", run_dir)


def test_sigkill_mid_sft_then_resume_gives_the_weights_of_an_uninterrupted_run(tiny_model_dir, tmp_path):
    straight = tiny_recipe(tiny_model_dir, tmp_path, train={"max_steps": 5, "eval_every": 2}, output={"save_every": 2})
    sft(straight)
    killed = dict(straight, output={**straight["output"], "dir": str(tmp_path / "killed")})
    recipe = tmp_path / "killed.yaml"
    recipe.write_text(yaml.safe_dump(killed))
    run_dir = Path(killed["output"]["dir"])
    dead = polo("sft", str(recipe), POLO_TEST_SIGKILL="fit:3")  # in step 3's backward: no chance to clean up
    assert dead.returncode == -signal.SIGKILL, dead.stdout + dead.stderr
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
    assert training_steps(run_dir) == [1, 2] and not (run_dir / "final").exists()
    again = polo("sft", str(recipe), "output.resume=true")
    assert again.returncode == 0, again.stdout + again.stderr
    assert training_steps(run_dir) == [1, 2, 3, 4, 5]  # from step 2's exact state, no step twice
    assert same_weights(tmp_path / "run", run_dir)
