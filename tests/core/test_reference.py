"""The adaptive KL coefficient (Ziegler et al. 2019), TR-DPO's reference mix-up and the entropy bonus, by hand."""

from __future__ import annotations

import pytest
import torch

from polo import core


def test_the_adaptive_coefficient_follows_the_rule_on_a_known_sequence():
    """β_{t+1} = β_t (1 + clip(KL_t / target − 1, ±0.2) n / H), target 0.1, n 100, H 1000: K_β = 0.1 as in the paper."""
    beta, values = 0.2, []
    for kl in (0.5, 0.12, 0.1, 0.09, 0.0, 0.2):
        beta = core.adaptive_kl_coefficient(beta, kl, target=0.1, horizon=1000, samples=100)
        values.append(beta)
    expected, beta = [], 0.2
    for error in (0.2, 0.2, 0.0, -0.1, -0.2, 0.2):  # 0.5 and 0.2 clip at +0.2, 0 at −0.2; 0.12: +0.2 exactly
        beta = beta * (1 + error * 0.1)
        expected.append(beta)
    assert values == pytest.approx(expected, rel=1e-12)
    assert values[:2] == pytest.approx([0.204, 0.20808], rel=1e-12) and values[2] == values[1]


def test_the_adaptive_coefficient_refuses_a_target_or_horizon_that_is_not_positive():
    with pytest.raises(ValueError, match="target > 0 and horizon > 0"):
        core.adaptive_kl_coefficient(0.1, 0.1, target=0.0, horizon=10, samples=4)


def test_mix_into_reference_is_alpha_policy_plus_one_minus_alpha_reference():
    reference = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]], dtype=torch.float64)]
    policy = [torch.tensor([3.0, -2.0]), torch.tensor([[0.0]], dtype=torch.float32)]
    core.mix_into_reference(reference, policy, 0.25)
    assert reference[0].tolist() == [1.5, 1.0] and reference[1].tolist() == [[3.0]]
    assert reference[1].dtype == torch.float64  # the reference keeps its own dtype
    core.mix_into_reference(reference, policy, 1.0)
    assert reference[0].tolist() == [3.0, -2.0]
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        core.mix_into_reference(reference, policy, 1.5)


def test_the_entropy_bonus_is_minus_c_times_the_micro_batchs_mean_entropy_whatever_the_aggregation():
    """TRL's reading: −c · (Σ m H / Σ m) / num_micro_batches; its gradient raises every counted token's entropy."""
    entropy = torch.tensor([[1.0, 3.0, 5.0], [2.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    normalisers = core.LossNormalisers(num_sequences=8, num_tokens=20, max_completion_length=3, num_micro_batches=2)
    bonus = core.entropy_bonus(entropy, mask, 0.3, normalisers)
    assert bonus.item() == pytest.approx(-0.3 * (1 + 3 + 2) / 3 / 2)
    bonus.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.05, -0.05, 0.0], [-0.05, 0.0, 0.0]]))
