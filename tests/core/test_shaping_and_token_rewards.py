"""Token-level rewards, REINFORCE++ advantages, DAPO's filter and overlong shaping, on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from polo import core


def test_token_level_rewards_put_the_sequence_reward_on_the_last_token_and_kl_everywhere():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    rewards = core.token_level_rewards(torch.tensor([1.0, -1.0, 5.0]), mask, kl, beta=0.5)
    expected = torch.tensor([[-0.05, -0.1, 1.0 - 0.15, 0.0], [-1.0 - 0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)


def test_reinforce_pp_whitens_reward_to_go_over_the_whole_batch():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    token_rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    advantages = core.reinforce_pp_advantages(token_rewards, mask, gamma=1.0)
    returns = torch.tensor([1.0, 1.0, 3.0, 3.0, 3.0])  # reward-to-go on the 5 valid tokens
    mean, std = returns.mean(), returns.std(unbiased=False)
    expected = torch.tensor([[(1 - mean) / std, (1 - mean) / std, 0.0], [(3 - mean) / std] * 3])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)


def test_informative_rows_drop_every_zero_spread_group():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5])
    kept = core.informative_rows(rewards, 3)
    assert kept.tolist() == [3, 4, 5, 6, 7, 8]  # groups 2 and 3 have spread; group 1 is flat
    assert not core.zero_spread_groups(rewards[kept], 3).any()


def test_overlong_penalty_follows_the_dapo_ramp():
    lengths = torch.tensor([10, 16, 18, 20, 19])
    # L_max = 20, L_cache = 4: no penalty up to 16, then linear down to -1 at 20
    penalty = core.overlong_penalty(lengths, max_length=20, buffer_length=4, penalty=1.0)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -0.75]))
    assert torch.equal(core.overlong_penalty(lengths, 20, 0), torch.zeros(5))
    torch.testing.assert_close(core.overlong_penalty(lengths, 20, 4, penalty=0.5), 0.5 * penalty)


def test_explained_variance():
    target = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert core.explained_variance(target, target, mask) == pytest.approx(1.0)
    assert core.explained_variance(torch.full_like(target, 2.0), target, mask) == pytest.approx(0.0)
    assert math.isnan(core.explained_variance(target, torch.ones_like(target), mask))
