"""Advantage estimators against numbers worked out by hand (arithmetic in the comments)."""

import math

import pytest
import torch

from polo.core import (
    decoupled_group_advantages,
    discounted_returns,
    expand_to_tokens,
    gae_advantages,
    group_advantages,
    rloo_advantages,
    whiten,
    zero_spread_groups,
)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # Group 1: mean 0.5, deviations ±0.5; unbiased var = 4 · 0.25 / (4 − 1) = 1/3, std = 0.57735.
    # Group 2: all equal → zeros.
    scale = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = torch.tensor([scale, -scale, -scale, scale, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, group_size=4), expected)


def test_dr_grpo_advantages_skip_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, group_size=4, scale_by_std=False), expected)


def test_equal_group_gives_exact_zeros_despite_rounding():
    # (0.1 + 0.1 + 0.1) / 3 ≠ 0.1 in floating point; the tiny residue must not be scaled by 1/eps.
    rewards = torch.full((3,), 0.1, dtype=torch.float64)
    assert torch.equal(group_advantages(rewards, group_size=3), torch.zeros(3, dtype=torch.float64))


def test_group_of_one_gives_zero_not_nan():
    assert torch.equal(group_advantages(torch.tensor([3.0, -2.0]), group_size=1), torch.zeros(2))


def test_group_size_must_divide_batch():
    with pytest.raises(ValueError, match="5.*group_size 4"):
        group_advantages(torch.zeros(5), group_size=4)


def test_rloo_baseline_excludes_the_sample():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 6.0])
    # Group 1: A_0 = 1 − (0 + 0 + 1)/3 = 2/3, A_1 = 0 − (1 + 0 + 1)/3 = −2/3.
    # Group 2 (sum 12): 3 − 9/3 = 0, 1 − 11/3 = −8/3, 2 − 10/3 = −4/3, 6 − 6/3 = 4.
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, -8 / 3, -4 / 3, 4.0])
    torch.testing.assert_close(rloo_advantages(rewards, group_size=4), expected)


def test_rloo_needs_two_per_group():
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.zeros(4), group_size=1)


def test_zero_spread_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert zero_spread_groups(rewards, 4).tolist() == [False, True]
    # Spread 0.05 is within atol 0.1 but not within the default exact test.
    assert zero_spread_groups(torch.tensor([1.0, 1.05]), 2, atol=0.1).tolist() == [True]
    assert zero_spread_groups(torch.tensor([1.0, 1.05]), 2).tolist() == [False]


def test_discounted_returns_by_hand():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 7.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # γ = 0.5. Row 0: G2 = 3, G1 = 2 + 0.5·3 = 3.5, G0 = 1 + 0.5·3.5 = 2.75.
    # Row 1: padding → 0, G1 = 7, G0 = 5 + 0.5·7 = 8.5.
    expected = torch.tensor([[2.75, 3.5, 3.0], [8.5, 7.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma=0.5), expected)


REWARDS = torch.tensor([[1.0, 0.0, 2.0]])
VALUES = torch.tensor([[0.5, 1.0, 1.5]])
FULL = torch.ones(1, 3)


def test_gae_lambda_one_is_monte_carlo_return_minus_value():
    # γ = 0.5: returns G = [1 + 0.5·1, 0 + 0.5·2, 2] = [1.5, 1, 2]; A = G − V = [1, 0, 0.5].
    advantages, returns = gae_advantages(REWARDS, VALUES, FULL, gamma=0.5, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 0.0, 0.5]]))
    torch.testing.assert_close(returns, torch.tensor([[1.5, 1.0, 2.0]]))


def test_gae_lambda_one_matches_discounted_returns_on_random_padded_batch():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 6, generator=generator)
    values = torch.randn(4, 6, generator=generator)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5, [1] * 5 + [0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    monte_carlo = discounted_returns(rewards, mask, gamma=0.9)
    torch.testing.assert_close(returns, monte_carlo)
    torch.testing.assert_close(advantages, (monte_carlo - values) * mask)


def test_gae_lambda_zero_is_one_step_td_error():
    # δ0 = 1 + 0.5·1.0 − 0.5 = 1.0, δ1 = 0 + 0.5·1.5 − 1.0 = −0.25, δ2 = 2 + 0.5·0 − 1.5 = 0.5.
    advantages, _ = gae_advantages(REWARDS, VALUES, FULL, gamma=0.5, lam=0.0)
    torch.testing.assert_close(advantages, torch.tensor([[1.0, -0.25, 0.5]]))
    # Bootstrapping with last_value = 2: δ2 = 2 + 0.5·2 − 1.5 = 1.5.
    advantages, _ = gae_advantages(REWARDS, VALUES, FULL, gamma=0.5, lam=0.0, last_value=torch.tensor([2.0]))
    torch.testing.assert_close(advantages, torch.tensor([[1.0, -0.25, 1.5]]))


def test_gae_intermediate_lambda():
    # γλ = 0.25: A2 = 0.5, A1 = −0.25 + 0.25·0.5 = −0.125, A0 = 1.0 + 0.25·(−0.125) = 0.96875.
    advantages, _ = gae_advantages(REWARDS, VALUES, FULL, gamma=0.5, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.96875, -0.125, 0.5]]))


def test_gae_bootstraps_after_last_valid_token_and_ignores_padding():
    rewards = torch.tensor([[1.0, 0.0, 123.0]])
    values = torch.tensor([[0.5, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    # λ = 0, last_value = 2: δ1 = 0 + 0.5·2 − 1 = 0, δ0 = 1 + 0.5·1 − 0.5 = 1; padding → 0.
    # returns = A + V = [1.5, 1.0, 0].
    advantages, returns = gae_advantages(rewards, values, mask, 0.5, 0.0, last_value=torch.tensor([2.0]))
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.5, 1.0, 0.0]]))


def test_whiten_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # Valid entries 1, 2, 3, 4: mean 2.5, population var = (2.25 + 0.25 + 0.25 + 2.25)/4 = 1.25.
    std = math.sqrt(1.25 + 1e-8)
    expected = torch.tensor([[-1.5, -0.5, 0.5], [1.5, 0.0, 0.0]]) / std
    torch.testing.assert_close(whiten(values, mask), expected)
    rescaled = expected + 2.5 * mask
    torch.testing.assert_close(whiten(values, mask, shift_mean=False), rescaled)


def test_expand_to_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    torch.testing.assert_close(expand_to_tokens(torch.tensor([2.0, -1.0]), mask), expected)
    with pytest.raises(ValueError, match=r"\(batch,\)"):
        expand_to_tokens(torch.zeros(3), mask)


# ---------------------------------------------------------------- right padding


HOLED_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])


def time_walking_calls(mask):
    """Every function that reads the first 0 of a row as its end, called on `mask`."""
    from polo.core import reinforce_pp_advantages, token_level_rewards

    rewards = torch.ones(mask.shape)
    return {
        "discounted_returns": lambda: discounted_returns(rewards, mask, 0.9),
        "gae_advantages": lambda: gae_advantages(rewards, torch.zeros(mask.shape), mask, 0.9, 0.95),
        "token_level_rewards": lambda: token_level_rewards(torch.ones(mask.shape[0]), mask),
        "reinforce_pp_advantages": lambda: reinforce_pp_advantages(rewards, mask),
    }


@pytest.mark.parametrize("name", list(time_walking_calls(HOLED_MASK)))
def test_masks_with_holes_are_refused_naming_the_row(name):
    with pytest.raises(ValueError, match=rf"^{name}: mask row 1 is not right-padded .*valid positions 0-1, 3\)"):
        time_walking_calls(HOLED_MASK)[name]()
    with pytest.raises(ValueError, match="mask row 0 "):  # a bool mask and a leading hole too
        time_walking_calls(torch.tensor([[False, True, True]]))[name]()


@pytest.mark.parametrize("name", list(time_walking_calls(HOLED_MASK)))
def test_right_padded_masks_pass_including_empty_and_full_rows(name):
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    advantages = first(time_walking_calls(mask)[name]())
    assert advantages.shape == mask.shape
    assert (advantages[mask == 0] == 0).all()  # nothing leaks into the padding, the empty row's included
    if name != "reinforce_pp_advantages":  # whitened over the batch, so its values depend on the other rows
        # A row ends at its first 0: the short row gets exactly what it would get unpadded, on its own.
        alone = first(time_walking_calls(torch.ones(1, 2))[name]())
        torch.testing.assert_close(advantages[1, :2], alone[0])


def first(result):
    """Return the advantages of a time-walking call (GAE also returns the returns)."""
    return result[0] if isinstance(result, tuple) else result


def test_batch_std_keeps_the_group_mean_and_divides_by_the_batchs_spread():
    # Lite PPO: each group's own mean as the baseline, the std of all 8 rewards as the scale; a flat group stays 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]) / (rewards.std() + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, group_size=4, batch_std=True), expected)
    # a group's own std would have scaled it by 1 / 0.5 instead
    assert not torch.allclose(group_advantages(rewards, group_size=4), expected)


def test_gdpo_normalises_each_reward_in_its_group_then_the_weighted_sum_over_the_batch():
    # Two groups of 2, two rewards: a 0/1 reward, and one 100 times wider. GRPO's sum is ruled by the wide one;
    # GDPO gives each reward ±1/√2 in its group first (unbiased std of two values a apart: a/√2). ε = 0 here.
    columns = torch.tensor([[1.0, 300.0], [0.0, 100.0], [0.0, 100.0], [1.0, 100.0]], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    half = 1 / math.sqrt(2)  # (r − mean)/std for the larger of two values
    per_reward = torch.tensor([[half, half], [-half, -half], [-half, 0.0], [half, 0.0]], dtype=torch.float64)
    summed = (per_reward * weights).sum(-1)
    expected = (summed - summed.mean()) / summed.std()
    advantages = decoupled_group_advantages(columns, weights, 2, eps=0.0)
    torch.testing.assert_close(advantages, expected)
    # in the second group the wide reward is flat: only the 0/1 reward ranks its completions
    assert advantages[3] > advantages[2]
    # a reward that does not apply (NaN) is left out of its group's statistics and adds 0 (a group left with one
    # value gets 0 from that reward); a row no reward applied to gets 0 and is left out of the batch statistics
    columns[1, 1] = torch.nan
    columns[3] = torch.nan
    scored = torch.tensor([True, True, True, False])
    advantages = decoupled_group_advantages(columns, weights, 2, eps=0.0, scored=scored)
    summed = torch.tensor([half, -half, 0.0], dtype=torch.float64)  # only the 0/1 reward of group 1 ranks
    expected = (summed - summed.mean()) / summed.std()
    torch.testing.assert_close(advantages, torch.cat([expected, torch.zeros(1, dtype=torch.float64)]))
