"""TRL's GRPO quick start, its reward functions and its dataset formats untouched, trained through `polo.train`."""

from __future__ import annotations

import json

import pytest
import torch

datasets = pytest.importorskip("datasets")
trl_rewards = pytest.importorskip("trl.rewards")  # TRL's own accuracy reward, as its quick start imports it

from test_trainer import tiny_config  # noqa: E402

import polo  # noqa: E402
from polo.data import HfSource, hf_task  # noqa: E402
from polo.generation.prompts import QUESTION_PLACEHOLDER  # noqa: E402
from polo.rewards import RewardSet  # noqa: E402
from polo.rl.step import scored_rows  # noqa: E402

accuracy_reward = trl_rewards.accuracy_reward

PROBLEMS = [("What is 2 + 2?", "4"), ("What is 3 + 5?", "8"), ("What is 6 + 1?", "7"), ("What is 9 + 9?", "18")]
# TRL's two dataset formats, with the `prompt` and `solution` columns of its quick start's dataset.
STANDARD = [{"prompt": question, "solution": answer} for question, answer in PROBLEMS]
CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": question}], "solution": answer} for question, answer in PROBLEMS
]


def reward_len(completions, **kwargs):
    """TRL's quick-start reward: completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def one_step(model_dir, output_dir, reward, rows):
    """Train one step on the tiny model with `reward` alone optimised, as TRL's quick start does, and return (metrics,
    samples)."""
    config = tiny_config(
        model_dir,
        output_dir,
        train={"steps": 1},
        eval={"before": False, "after": False},
        output={"save_every": 0, "report_to": [], "plots": False},
    )
    config["task"], config["rewards"] = {"num_eval": 0}, {"correct": 0.0}  # accuracy logged, not optimised
    result = polo.train(config, reward_functions={reward: 1.0}, train_dataset=datasets.Dataset.from_list(rows))
    samples = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    return result.metrics, samples


def test_the_length_reward_over_standard_prompts(tiny_model_dir, tmp_path):
    metrics, samples = one_step(tiny_model_dir, tmp_path / "run", reward_len, STANDARD)
    assert len(metrics) == 1 and "reward/reward_len/mean" in metrics[0] and metrics[0]["grad_norm"] > 0
    for sample in samples:
        assert sample["rewards"]["reward_len"] == -abs(20 - len(sample["completion"]))
        # A TRL prompt is the whole prompt: no instruction of polo's is added to it.
        question = next(question for question, _ in PROBLEMS if question in sample["prompt"])
        assert sample["prompt"] == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def test_the_accuracy_reward_over_conversational_prompts(tiny_model_dir, tmp_path):
    task = hf_task(HfSource(train_dataset=CONVERSATIONAL))
    assert task.instruction == QUESTION_PLACEHOLDER
    rows = [task.train_rows[0], task.train_rows[0]]  # "What is 2 + 2?", solution "4"
    total, _ = RewardSet({accuracy_reward: 1.0}, task).score([r"so \boxed{4}", r"so \boxed{5}"], rows)
    assert total.tolist() == [1.0, 0.0]  # TRL's function got its messages and the solution column

    metrics, samples = one_step(tiny_model_dir, tmp_path / "run", accuracy_reward, CONVERSATIONAL)
    assert len(metrics) == 1 and "reward/accuracy_reward/mean" in metrics[0]
    assert all(sample["prompt"].startswith("<|im_start|>user\nWhat is ") for sample in samples)


def test_a_completion_no_reward_applied_to_is_marked_unscored_for_the_advantages():
    nan = float("nan")
    columns = {
        "only_long": torch.tensor([1.0, nan, nan, 0.0]),
        "only_short": torch.tensor([nan, nan, 2.0, nan]),
        "overlong": torch.tensor([0.0, 0.0, 0.0, 0.0]),  # shaping, never None: not a reward function
    }
    assert scored_rows(columns, ["only_long", "only_short"]).tolist() == [True, False, True, True]
    assert scored_rows(columns, ["overlong"]) is None  # every completion scored
