"""Every algorithm preset runs over the one loop on a tiny model; DAPO's filter, PPO's critic and its resume."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import final_weights, tiny_config, without_times

from polo import core
from polo.config import PRESETS, load_config
from polo.generation.cpu_sampler import rollout
from polo.generation.rollouts import Decoding
from polo.models.loading import load_policy
from polo.rl import step as rl_step_module
from polo.rl.batching import UpdateBatch
from polo.rl.train import train
from polo.rl.update import Learner, policy_update
from polo.runtime.device import CPU


def digit_share(completion: str, row: dict) -> float:
    """A dense reward a random tiny model already varies on: the share of digits in the completion."""
    return sum(char.isdigit() for char in completion) / max(len(completion), 1)


def changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_trains(name, tiny_model_dir, tmp_path):
    result = train(
        tiny_config(tiny_model_dir, tmp_path / name, eval={"before": False, "after": False}),
        [f"algorithm.name={name}", "train.steps=2"],
        reward_functions={digit_share: 1.0},
    )
    rows = [row for row in result.metrics if "reward/mean" in row]
    assert [row["step"] for row in rows] == [1, 2]
    updated = [row for row in rows if "loss" in row]
    assert updated and all(torch.isfinite(torch.tensor(row["loss"])) for row in updated)
    if name in ("ppo", "reinforce_pp"):  # KL to the reference folded into the reward
        assert all("kl" in row for row in updated)
    if name == "ppo":
        assert all("value/loss" in row and "value/explained_variance" in row for row in updated)
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert changed(initial, final_weights(tmp_path / name))


def test_dapo_dynamic_sampling_never_trains_on_a_zero_spread_group(tiny_model_dir, tmp_path, monkeypatch):
    def parity(completion: str, row: dict) -> float:
        # Prompts with an even first operand always score 1 (a zero-spread group); odd ones score
        # by completion length, which varies within a group.
        return 1.0 if row["operands"][0] % 2 == 0 else float(len(completion) % 2)

    batches, real_collect = [], rl_step_module.collect_batch

    def recording_collect(*args, **kwargs):
        sampled = real_collect(*args, **kwargs)
        batches.append((sampled.batch, sampled.metrics))
        return sampled

    monkeypatch.setattr(rl_step_module, "collect_batch", recording_collect)
    config = tiny_config(tiny_model_dir, tmp_path / "dapo", eval={"before": False, "after": False})
    train(
        config,
        ["algorithm.name=dapo", "train.steps=4", "train.prompts_per_step=3", "algorithm.max_sampling_rounds=4"],
        reward_functions={parity: 1.0},
    )
    assert len(batches) == 4
    assert any(metrics["zero_spread_group_fraction"] > 0 for _, metrics in batches)  # the filter had work to do
    for batch, metrics in batches:
        assert batch is not None
        assert not core.zero_spread_groups(batch.rewards, 4).any()
        assert len(batch.rollouts) == 4 * metrics["dynamic_sampling/groups_kept"] <= 4 * 3
        assert len(batch.prompts) == metrics["dynamic_sampling/groups_kept"]


def test_dapo_masks_truncated_completions_out_of_the_loss(tiny_model_dir):
    config = load_config(
        tiny_config(tiny_model_dir, "unused"), ["algorithm.name=dapo", "algorithm.mask_truncated=true"]
    )
    model, tokenizer = load_policy(str(tiny_model_dir))
    torch.manual_seed(0)
    batch = rollout(model, tokenizer, ["1+1=", "2+2="], 4, Decoding(6, temperature=1.0))
    advantages = torch.linspace(-1, 1, 8)

    def grad_norm(truncated: bool) -> float:
        batch.truncated[:] = truncated
        probe, _ = load_policy(str(tiny_model_dir))
        optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        learner = Learner(probe, optimizer, scheduler, CPU)
        return policy_update(learner, UpdateBatch(batch, advantages), config)["grad_norm"]

    assert grad_norm(truncated=True) == 0.0  # every completion was cut by max_new_tokens: nothing to learn from
    assert grad_norm(truncated=False) > 0.0


@pytest.mark.parametrize("layout", ["separate", "head"])
def test_critic_warmup_moves_only_the_critic(layout, tiny_model_dir, tmp_path):
    result = train(
        tiny_config(tiny_model_dir, tmp_path / layout, eval={"before": False, "after": False}),
        [
            "algorithm.name=ppo",
            f"algorithm.critic={layout}",
            "algorithm.critic_warmup_steps=2",
            "train.steps=2",
            "algorithm.critic_learning_rate=1e-2",
        ],
        reward_functions={digit_share: 1.0},
    )
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert not changed(initial, final_weights(tmp_path / layout))  # the policy did not move
    rows = [row for row in result.metrics if "value/loss" in row]
    assert len(rows) == 2 and rows[1]["value/loss"] != rows[0]["value/loss"]
    assert all("entropy" not in row for row in rows)


@pytest.mark.parametrize("layout", ["separate", "head"])
def test_ppo_resume_restores_the_critic(layout, tiny_model_dir, tmp_path):
    overrides = ["algorithm.name=ppo", f"algorithm.critic={layout}", "algorithm.critic_learning_rate=1e-2"]
    rewards = {digit_share: 1.0}
    straight = train(
        tiny_config(tiny_model_dir, tmp_path / "straight", eval={"before": False, "after": False}),
        overrides + ["train.steps=4"],
        reward_functions=rewards,
    )
    first = tiny_config(tiny_model_dir, tmp_path / "resumed", eval={"before": False, "after": False})
    train(first, overrides + ["train.steps=2"], reward_functions=rewards)
    resumed = train(first, overrides + ["train.steps=4", "output.resume=true"], reward_functions=rewards)
    assert without_times(resumed.metrics) == without_times(straight.metrics)


def test_gdpo_reads_each_rewards_column_and_weight(tiny_model_dir, tmp_path):
    """The step hands the gdpo estimator every term of the total: each reward function's column with its weight,
    and a shaping column (DAPO's overlong penalty) with weight 1; a polo train run with two rewards trains."""
    from types import SimpleNamespace

    from polo.rl.batching import Batch
    from polo.rl.step import PreUpdateScores, compute_advantages

    config = load_config(tiny_config(tiny_model_dir, "unused"), ["algorithm.advantage_estimator=gdpo"])
    generator = torch.Generator().manual_seed(0)
    columns = {name: torch.rand(8, generator=generator) for name in ("digits", "length", "overlong")}
    weights = {"digits": 1.0, "length": 0.25}
    total = columns["digits"] + 0.25 * columns["length"] + columns["overlong"]
    rollouts = SimpleNamespace(completion_mask=torch.ones(8, 3, dtype=torch.long))
    update = compute_advantages(Batch(rollouts, total, ["a", "b"], columns), PreUpdateScores(), config, weights)
    stacked = torch.stack(list(columns.values()), dim=1)
    expected = core.decoupled_group_advantages(stacked, torch.tensor([1.0, 0.25, 1.0]), 4, eps=1e-4)
    torch.testing.assert_close(update.advantages[:, 0], expected)
    grpo = core.group_advantages(total, 4)
    assert not torch.allclose(expected, grpo, atol=1e-3)  # not the normalised sum

    def length(completion: str, row: dict) -> float:
        return float(len(completion))

    result = train(
        tiny_config(tiny_model_dir, tmp_path / "gdpo", eval={"before": False, "after": False}),
        ["algorithm.advantage_estimator=gdpo", "train.steps=2"],
        reward_functions={digit_share: 1.0, length: 0.01},
    )
    rows = [row for row in result.metrics if "loss" in row]
    assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)


def test_the_sampler_correction_and_the_off_policy_mask_train(tiny_model_dir, tmp_path, monkeypatch):
    """polo train with the sampler correction: the CPU sampler records its log-probs, the update weighs each token by
    π_old/μ (in fp32 on the CPU the two forwards agree, so every weight is 1 to 1e-4, and the logged gap is as small),
    and the off-policy mask is logged."""
    weights, real = [], core.sampler_correction_weights

    def recording(*args, **kwargs):
        weights.append(real(*args, **kwargs))
        return weights[-1]

    monkeypatch.setattr(core, "sampler_correction_weights", recording)
    result = train(
        tiny_config(tiny_model_dir, tmp_path / "corrected", eval={"before": False, "after": False}),
        [
            "algorithm.sampler_correction=token_mask",
            "algorithm.sampler_correction_min=0.5",
            "algorithm.off_policy_mask_threshold=0.1",
            "train.num_minibatches=2",
            "train.prompts_per_step=2",
            "train.steps=2",
        ],
        reward_functions={digit_share: 1.0},
    )
    rows = [row for row in result.metrics if "loss" in row]
    assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)
    assert all(0.0 <= row["off_policy/masked_fraction"] <= 1.0 for row in rows)
    assert all(0.0 <= row["sampler/logprob_gap"] < 1e-4 for row in rows)
    assert len(weights) == 2
    for batch_weights in weights:
        assert torch.allclose(batch_weights, torch.ones_like(batch_weights), atol=1e-4)
