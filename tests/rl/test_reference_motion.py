"""The adaptive KL coefficient and the reference's mix-up toward the policy, through `polo train`."""

from __future__ import annotations

import copy

import pytest
import torch
from test_trainer import without_times

from conftest import tiny_rl_config
from polo import core
from polo.config import ConfigError, load_config
from polo.rl import step as step_module
from polo.rl.setup import set_up
from polo.rl.train import train

COMPLETIONS = 8  # prompts_per_step 2 x group_size 4: the controller's n_t per step


def digit_share(completion: str, row: dict) -> float:
    """A dense reward a random tiny model already varies on: the share of digits in the completion."""
    return sum(char.isdigit() for char in completion) / max(len(completion), 1)


def config_for(tiny_model_dir, output_dir, steps: int = 3) -> dict:
    return tiny_rl_config(
        tiny_model_dir,
        output_dir,
        eval={"before": False, "after": False},
        train={"steps": steps, "learning_rate": 3e-2, "warmup_steps": 0},
        output={"save_every": 1},
    )


# GRPO takes the KL in the loss (k3); PPO folds it into the per-token rewards (k1, kl_in_reward).
ADAPTIVE = {
    "grpo": ["algorithm.beta=0.04", "algorithm.kl_target=0.001", f"algorithm.kl_horizon={COMPLETIONS}"],
    "ppo": ["algorithm.name=ppo", "algorithm.kl_target=0.001", f"algorithm.kl_horizon={COMPLETIONS}"],
}


@pytest.mark.parametrize("algorithm", sorted(ADAPTIVE))
def test_the_adaptive_controller_moves_beta_each_step_and_the_step_trains_with_it(
    algorithm, tiny_model_dir, tmp_path, monkeypatch
):
    used, real_policy_update = [], step_module.policy_update

    def policy_update(learner, batch, config, **kwargs):
        used.append(config.algorithm.beta)
        return real_policy_update(learner, batch, config, **kwargs)

    monkeypatch.setattr(step_module, "policy_update", policy_update)
    result = train(config_for(tiny_model_dir, tmp_path / "run"), ADAPTIVE[algorithm], reward_functions={digit_share: 1})
    rows = [row for row in result.metrics if "beta" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    betas = [row["beta"] for row in rows]
    assert betas == pytest.approx(used, rel=0, abs=0)  # the logged beta is the one the step trained with
    assert betas[0] == (0.04 if algorithm == "grpo" else 0.05)  # algorithm.beta, or the ppo preset's
    for row, following in zip(rows, betas[1:]):
        assert following == core.adaptive_kl_coefficient(row["beta"], row["kl"], 0.001, COMPLETIONS, COMPLETIONS)
    assert len(set(betas)) == 3  # K_β = n / H = 1: each step moves beta by up to 20 %


def test_a_resumed_run_keeps_the_adaptive_beta(tiny_model_dir, tmp_path):
    rewards, overrides = {digit_share: 1}, ADAPTIVE["grpo"]
    straight = train(config_for(tiny_model_dir, tmp_path / "straight", steps=3), overrides, reward_functions=rewards)
    first = config_for(tiny_model_dir, tmp_path / "resumed", steps=2)
    train(first, overrides, reward_functions=rewards)
    resumed = train(first, overrides + ["train.steps=3", "output.resume=true"], reward_functions=rewards)
    assert without_times(resumed.metrics) == without_times(straight.metrics)
    assert resumed.metrics[-1]["beta"] != 0.04


def test_the_reference_becomes_the_mix_after_every_n_steps(tiny_model_dir, tmp_path):
    overrides = [
        "algorithm.beta=0.04",
        "algorithm.sync_ref_model=true",
        "algorithm.ref_model_sync_steps=2",
        "algorithm.ref_model_mixup_alpha=0.3",
    ]
    run = set_up(config_for(tiny_model_dir, tmp_path / "run"), overrides, reward_functions={digit_share: 1})
    before = copy.deepcopy(run.reference.state_dict())
    step_module.rl_step(run, 1)
    assert all(torch.equal(run.reference.state_dict()[name], value) for name, value in before.items())
    step_module.rl_step(run, 2)
    policy = dict(run.model.named_parameters())
    for name, value in run.reference.named_parameters():
        assert torch.equal(value, before[name].mul(1.0 - 0.3).add(policy[name].detach(), alpha=0.3)), name
    assert any(not torch.equal(value, before[name]) for name, value in run.reference.named_parameters())
    assert any(not torch.equal(value, policy[name]) for name, value in run.reference.named_parameters())


def test_a_resumed_run_restores_the_moved_reference(tiny_model_dir, tmp_path):
    rewards = {digit_share: 1}
    overrides = ["algorithm.beta=0.04", "algorithm.sync_ref_model=true", "algorithm.ref_model_sync_steps=1"]
    straight = train(config_for(tiny_model_dir, tmp_path / "straight", steps=3), overrides, reward_functions=rewards)
    first = config_for(tiny_model_dir, tmp_path / "resumed", steps=2)
    train(first, overrides, reward_functions=rewards)
    resumed = train(first, overrides + ["train.steps=3", "output.resume=true"], reward_functions=rewards)
    assert without_times(resumed.metrics) == without_times(straight.metrics)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["algorithm.kl_target=0.1"], "algorithm.kl_target needs algorithm.beta > 0"),
        (["algorithm.sync_ref_model=true"], "algorithm.sync_ref_model needs algorithm.beta > 0"),
        (["algorithm.sync_ref_model=true", "algorithm.beta=0.1", "model.lora.r=4"], "set model.lora.r=0"),
        (["algorithm.kl_target=0"], "algorithm.kl_target"),
    ],
)
def test_a_reference_setting_without_its_reference_is_one_line(overrides, says, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(config_for(tiny_model_dir, tmp_path), overrides)
    assert says in str(error.value) and "\n" not in str(error.value)
