"""`algorithm.entropy_coef`: the entropy bonus trains through `polo train`'s step and raises the policy's entropy."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, tiny_rl_config
from polo.config import ConfigError
from polo.models.scoring import completion_logprobs
from polo.rl import step as step_module
from polo.rl.setup import check_entropy_bonus, set_up


def same_for_all(completion: str, row: dict) -> float:
    """A constant reward: every group's advantages are 0, so only the entropy bonus has a gradient."""
    return 1.0


@torch.no_grad()
def mean_entropy(model, rollouts, temperature: float) -> float:
    inputs = (rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids, rollouts.completion_mask)
    _, entropy = completion_logprobs(model, *inputs, temperature=temperature, with_entropy=True)
    mask = rollouts.completion_mask.float()
    return float((entropy * mask).sum() / mask.sum())


def update_on_one_batch(tiny_model_dir, output_dir, monkeypatch, entropy_coef: float) -> tuple[dict, float, float]:
    """Return one step's metrics and the policy's mean entropy on that step's batch before and after its update."""
    config = tiny_rl_config(
        tiny_model_dir,
        output_dir,
        sampling={"temperature": 0.5},  # below the random tiny model's near-uniform entropy: room to rise
        eval={"before": False, "after": False},
        train={"steps": 1, "learning_rate": 1e-2, "warmup_steps": 0, "weight_decay": 0.0, "micro_batch_size": 8},
    )
    config["rewards"] = {"correct": 0.0}  # scored but weighted 0: the total reward is constant
    run = set_up(config, [f"algorithm.entropy_coef={entropy_coef}"], reward_functions={same_for_all: 1.0})
    entropies, real_policy_update = [], step_module.policy_update

    def policy_update(learner, batch, config, **kwargs):
        entropies.append(mean_entropy(learner.model, batch.rollouts, 0.5))
        metrics = real_policy_update(learner, batch, config, **kwargs)
        entropies.append(mean_entropy(learner.model, batch.rollouts, 0.5))
        return metrics

    monkeypatch.setattr(step_module, "policy_update", policy_update)
    metrics = step_module.rl_step(run, 1).metrics
    return metrics, *entropies


def test_the_entropy_bonus_alone_raises_the_policys_entropy(tiny_model_dir, tmp_path, monkeypatch):
    metrics, before, after = update_on_one_batch(tiny_model_dir, tmp_path / "without", monkeypatch, 0.0)
    assert metrics["grad_norm"] == 0.0 and after == before  # zero advantages: nothing to learn
    metrics, before, after = update_on_one_batch(tiny_model_dir, tmp_path / "with", monkeypatch, 0.5)
    assert metrics["grad_norm"] > 0 and after > before + 1e-3
    assert metrics["entropy"] == pytest.approx(before, rel=1e-5)  # measured under the policy that sampled
    assert metrics["loss"] == pytest.approx(-0.5 * before, rel=1e-5)  # −c · the one micro-batch's mean entropy


def test_an_entropy_bonus_on_a_model_that_post_processes_its_logits_is_one_line():
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    check_entropy_bonus(model, 0.0)  # off: nothing to check
    with pytest.raises(ConfigError) as error:
        check_entropy_bonus(model, 0.01)
    assert "algorithm.entropy_coef=0.01" in str(error.value) and "\n" not in str(error.value)
