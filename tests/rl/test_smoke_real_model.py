"""Two GRPO steps on the real default model (fetched and converted once by `make test`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polo.rl.train import train


@pytest.mark.slow
def test_two_grpo_steps_on_the_default_model(tmp_path):
    result = train(
        str(Path(__file__).resolve().parents[2] / "recipes" / "grpo_arith.yaml"),
        [
            "train.steps=2",
            "train.prompts_per_step=2",
            "algorithm.group_size=4",
            "sampling.max_new_tokens=16",
            "task.num_eval=8",
            "algorithm.beta=0.04",
            f"output.dir={tmp_path}",
            "output.progress=false",
        ],
    )
    rows = [row for row in result.metrics if "reward/mean" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["grad_norm"] >= 0 and row["kl"] >= 0 for row in rows)
    # the pretrained model writes real text about the question, not noise
    assert any(any(ch.isdigit() for ch in sample["completion"]) for sample in result.eval_before["samples"])
    assert (tmp_path / "checkpoints" / "step-000002" / "model.safetensors").exists()
