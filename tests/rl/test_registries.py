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
"""A user's own advantage estimator and policy losses, registered by decorators."""
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
def plain_pg(inputs, settings):
    """REINFORCE: -A log pi, no ratio and no clipping."""
    Path("loss_calls.txt").open("a").write("1\\n")
    return vanilla_pg_loss(inputs.logprobs, inputs.advantages, inputs.mask), {}


@register_policy_loss("cispo")
def cispo(inputs, settings):
    """CISPO (MiniMax-M1): -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A log pi on every valid token. The clip
    range is the recipe's, read from `settings` as the built-in losses read theirs."""
    valid = inputs.mask.bool()
    ratio = torch.exp(torch.where(valid, inputs.logprobs.detach() - inputs.old_logprobs, 0.0))
    weight = ratio.clamp(1 - settings.clip_eps_low, 1 + settings.clip_eps_high)
    advantages = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]
    with Path("cispo_calls.jsonl").open("a") as log:
        call = {
            "eps": [settings.clip_eps_low, settings.clip_eps_high],
            "ratio": [float(ratio[valid].min()), float(ratio[valid].max())],
            "weight": [float(weight[valid].min()), float(weight[valid].max())],
        }
        log.write(json.dumps(call) + "\\n")
    per_token = torch.where(valid, -weight * advantages * inputs.logprobs, 0.0)
    return per_token, {"clip_high_count": (valid & (ratio > 1 + settings.clip_eps_high)).sum().float()}
'''


def test_presets_name_registered_functions():
    for name in PRESETS:
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
        ConfigError,
        match=r"algorithm.advantage_estimator: 'grpoo' is not a registered advantage estimator "
        r"\(did you mean 'grpo'\?\); registered: grpo, rloo, reinforce_pp, gae, gdpo",
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
    algorithm = {"advantage_estimator": "my_algorithms:batch_centered", "policy_loss": "my_algorithms:plain_pg"}
    rows = run_user_recipe(tmp_path, tiny_model_dir, algorithm, {"steps": 2})
    calls = [json.loads(line) for line in (tmp_path / "estimator_calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2  # one batch per step
    for call in calls:
        rewards = torch.tensor(call["rewards"])
        assert torch.allclose(torch.tensor(call["advantages"]), rewards - rewards.mean())
    assert len((tmp_path / "loss_calls.txt").read_text().split()) >= 2
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["algorithm"]["advantage_estimator"] == "my_algorithms:batch_centered"  # a resumed run imports it again


def run_user_recipe(tmp_path, tiny_model_dir, algorithm: dict, train: dict) -> list[dict]:
    """Run `polo train` on a recipe naming `my_algorithms` parts, in `tmp_path`; return its metrics rows."""
    (tmp_path / "my_algorithms.py").write_text(USER_MODULE)
    recipe = tiny_config(tiny_model_dir, tmp_path / "run", eval={"before": False, "after": False})
    recipe["algorithm"].update(algorithm)
    recipe["train"].update(train)
    recipe["output"].update({"plots": False, "report_to": []})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    polo = Path(sys.executable).with_name("polo")
    finished = subprocess.run(
        [str(polo), "train", "recipe.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_user_loss_reads_its_settings_and_trains_off_policy_through_polo_train(tiny_model_dir, tmp_path):
    """CISPO from the user's module gets the recipe's clip range through `settings`; no loop code knows of it."""
    rows = run_user_recipe(
        tmp_path,
        tiny_model_dir,
        {"policy_loss": "my_algorithms:cispo", "clip_eps_low": 0.5, "clip_eps_high": 0.02, "update_epochs": 2},
        {"steps": 2, "num_minibatches": 2, "learning_rate": 0.05},
    )
    calls = [json.loads(line) for line in (tmp_path / "cispo_calls.jsonl").read_text().splitlines()]
    assert calls and all(call["eps"] == [0.5, 0.02] for call in calls)  # the recipe's values reached the loss
    for call in calls:
        assert 0.5 - 1e-6 <= call["weight"][0] <= call["weight"][1] <= 1.02 + 1e-6
    # After the first minibatch step the policy has moved: old log-probs differ and the weights are clipped.
    assert any(call["ratio"][1] > 1.02 for call in calls)
    updates = [row for row in rows if "loss" in row]
    assert [row["step"] for row in updates] == [1, 2]
    assert any(row["clip_fraction/high"] > 0 for row in updates)  # the loss's own stats reach the metrics


def test_old_aggregation_names_are_read_as_the_functions_named_for_what_they_compute(tmp_path):
    aliases = {
        "grpo": "seq_mean_token_mean",
        "dapo": "token_mean",
        "dr_grpo": "seq_mean_token_sum_norm",
        "bnpo": "micro_batch_token_mean",
    }
    for old, new in aliases.items():
        assert load_config(None, [f"algorithm.loss_aggregation={old}"]).algorithm.loss_aggregation == new
        assert new in core.LOSS_AGGREGATIONS
    # A config.yaml written before the rename (every checkpoint and model card carries one) loads as it ran.
    before = {"algorithm": {"name": "dr_grpo", "loss_aggregation": "dr_grpo"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(before))
    assert load_config(tmp_path / "config.yaml").algorithm.loss_aggregation == "seq_mean_token_sum_norm"
    assert {name: PRESETS[name]["loss_aggregation"] for name in ("grpo", "dapo", "dr_grpo")} == {
        "grpo": "seq_mean_token_mean",
        "dapo": "token_mean",
        "dr_grpo": "seq_mean_token_sum_norm",
    }  # the paper names live in the presets; the functions are named for their maths
