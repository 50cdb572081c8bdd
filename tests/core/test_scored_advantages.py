"""GRPO advantages with completions no reward applied to: left out of their group's statistics, advantage 0."""

from __future__ import annotations

import pytest
import torch

from polo import core
from polo.core.advantages import group_advantages, scored_group_advantages


def trl_reading(rewards: torch.Tensor, group_size: int, scale: bool, eps: float) -> torch.Tensor:
    """TRL 1.16's reading, written out: unscored rewards are NaN, the group's mean and Bessel std are taken over the
    others, and a NaN advantage becomes 0."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.nanmean(dim=1, keepdim=True)
    count = (~grouped.isnan()).sum(dim=1, keepdim=True)
    std = (((grouped - mean) ** 2).nansum(dim=1, keepdim=True) / (count - 1)).sqrt()
    advantages = grouped - mean
    if scale:
        advantages = advantages / (std + eps)
    return torch.nan_to_num(advantages, nan=0.0).reshape(-1)


@pytest.mark.parametrize("scale", [True, False])
def test_unscored_completions_leave_the_group_statistics_as_trl_does(scale):
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0, 1.0, 4.0, 0.0], dtype=torch.float64)
    scored = torch.tensor([True, False, True, True, True, True, False, True])
    advantages = scored_group_advantages(rewards, scored, 4, scale, 1e-4)
    expected = trl_reading(torch.where(scored, rewards, torch.nan), 4, scale, 1e-4)
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
    assert advantages[1] == 0 and advantages[6] == 0
    # The scored completions get what their group alone would give them.
    alone = group_advantages(rewards[[0, 2, 3]], 3, scale, 1e-4)
    torch.testing.assert_close(advantages[[0, 2, 3]], alone, rtol=1e-12, atol=1e-12)


def test_a_group_with_fewer_than_two_scored_or_equal_scored_rewards_gets_zero():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 7.0, 2.0])
    scored = torch.tensor([True, False, False, False, True, True, False, True])
    assert scored_group_advantages(rewards, scored, 4).tolist() == [0.0] * 8


def test_all_scored_is_plain_grpo_and_the_estimator_takes_the_mask():
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0, 1.0, 4.0, 0.0])
    every = torch.ones(8, dtype=torch.bool)
    torch.testing.assert_close(scored_group_advantages(rewards, every, 4), group_advantages(rewards, 4))
    settings = type("Settings", (), {"scale_rewards": True, "advantage_eps": 1e-4})()
    mask = torch.ones(8, 3)
    scored = torch.tensor([True, False, True, True, True, True, False, True])
    inputs = core.AdvantageInputs(rewards, mask, 4, scored=scored)
    advantages, _ = core.ADVANTAGE_ESTIMATORS["grpo"](inputs, settings)
    torch.testing.assert_close(advantages[:, 0], scored_group_advantages(rewards, scored, 4))
