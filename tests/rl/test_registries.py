"""Algorithms are registered functions: a user's own estimator and loss train through `polo train`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_trainer import tiny_config

from polo import core
from polo.config import PRESETS, ConfigError, load_config

USER_MODULE = '''
"""A user's own advantage estimator and policy loss, registered by decorators."""
import json
from pathlib import Path

import torch

from polo.core import expand_to_tokens, register_advantage, register_policy_loss, vanilla_pg_loss


@register_advantage("batch_centered")
def batch_centered(inputs, settings):
    """r_i minus the mean reward of the whole batch, on every token of completion i."""
    advantages = inputs.rewards - inputs.rewards.mean()
    with Path("estimator_calls.jsonl").open("a") as log:
        log.write(json.dumps({"rewards": inputs.rewards.tolist(), "advantages": advantages.tolist()}) + "\\n")
    return expand_to_tokens(advantages, inputs.mask), None


@register_policy_loss("plain_pg")
def plain_pg(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    """REINFORCE: -A log pi, no ratio and no clipping."""
    Path("loss_calls.txt").open("a").write("1\\n")
    zero = torch.zeros(())
    return vanilla_pg_loss(logprobs, advantages, mask), {"clip_low_count": zero, "clip_high_count": zero}
'''


def test_presets_name_registered_functions():
    for name, preset in PRESETS.items():
        config = load_config({"algorithm": {"name": name}})
        alg = config.algorithm
        assert alg.advantage_estimator in core.ADVANTAGE_ESTIMATORS, name
        assert alg.policy_loss in core.POLICY_LOSSES, name
        assert alg.loss_aggregation in core.LOSS_AGGREGATIONS, name
        assert alg.kl_estimator in core.KL_ESTIMATORS, name
    assert core.ADVANTAGE_ESTIMATORS.entry("gae").needs_critic
    assert not core.ADVANTAGE_ESTIMATORS.entry("grpo").needs_critic


def test_grpo_estimator_is_the_group_advantage_on_every_token():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1, 0]] * 6).float()
    settings = load_config({}).algorithm
    advantages, returns = core.ADVANTAGE_ESTIMATORS["grpo"](core.AdvantageInputs(rewards, mask, 2), settings)
    expected = core.group_advantages(rewards, 2, scale_by_std=True, eps=settings.advantage_eps)
    assert returns is None
    assert torch.equal(advantages, expected[:, None] * mask)


def test_unknown_names_list_the_registered_ones(tmp_path, monkeypatch):
    with pytest.raises(
        ConfigError, match="algorithm.advantage_estimator: 'grpoo' is not one of grpo, rloo, reinforce_pp, gae"
    ):
        load_config({"algorithm": {"advantage_estimator": "grpoo"}})
    with pytest.raises(ConfigError, match="algorithm.policy_loss: cannot import module 'no_such_module'"):
        load_config({"algorithm": {"policy_loss": "no_such_module:plain_pg"}})
    (tmp_path / "empty_plugin.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match="module 'empty_plugin' registered no advantage estimator named 'mine'; registered: grpo, rloo",
    ):
        load_config({"algorithm": {"advantage_estimator": "empty_plugin:mine"}})


def test_user_registered_estimator_and_loss_train_through_polo_train(tiny_model_dir, tmp_path):
    (tmp_path / "my_algorithms.py").write_text(USER_MODULE)
    recipe = tiny_config(tiny_model_dir, tmp_path / "run", eval={"before": False, "after": False})
    recipe["algorithm"].update(
        {"advantage_estimator": "my_algorithms:batch_centered", "policy_loss": "my_algorithms:plain_pg"}
    )
    recipe["train"].update({"steps": 2})
    recipe["output"].update({"plots": False, "report_to": []})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    polo = Path(sys.executable).with_name("polo")
    finished = subprocess.run(
        [str(polo), "train", "recipe.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    calls = [json.loads(line) for line in (tmp_path / "estimator_calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2  # one batch per step
    for call in calls:
        rewards = torch.tensor(call["rewards"])
        assert torch.allclose(torch.tensor(call["advantages"]), rewards - rewards.mean())
    assert len((tmp_path / "loss_calls.txt").read_text().split()) >= 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["algorithm"]["advantage_estimator"] == "my_algorithms:batch_centered"  # a resumed run imports it again
