"""The reward model's pairwise loss and the DPO loss against numbers worked out by hand."""

import math

import pytest
import torch

from polo.core import dpo_loss, pairwise_loss


def test_pairwise_loss_by_hand():
    chosen = torch.tensor([2.0, 0.0, -1.0])
    rejected = torch.tensor([0.0, 0.0, 1.0])
    # −log σ(2) = log(1 + e^−2) = 0.126928;  −log σ(0) = log 2;  −log σ(−2) = log(1 + e^2) = 2.126928
    expected = torch.tensor([math.log1p(math.exp(-2)), math.log(2), math.log1p(math.exp(2))])
    torch.testing.assert_close(pairwise_loss(chosen, rejected), expected)


def test_pairwise_loss_gradient_pushes_the_margin_up():
    chosen = torch.tensor([1.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    pairwise_loss(chosen, rejected).sum().backward()
    # d/dr_w −log σ(r_w − r_l) = −(1 − σ(1)) = −0.268941; the rejected reward gets the opposite
    torch.testing.assert_close(chosen.grad, torch.tensor([-(1 - 1 / (1 + math.exp(-1)))]))
    torch.testing.assert_close(rejected.grad, -chosen.grad)


def test_pairwise_loss_stays_finite_for_huge_margins():
    loss = pairwise_loss(torch.tensor([0.0, 1000.0]), torch.tensor([1000.0, 0.0]))
    torch.testing.assert_close(loss, torch.tensor([1000.0, 0.0]))


def test_dpo_loss_by_hand():
    # pair 0: β = 0.5, chosen log-ratio −5 − (−6) = 1, rejected −9 − (−7) = −2:
    #   r_w = 0.5, r_l = −1, loss = −log σ(1.5) = log(1 + e^−1.5) = 0.201413
    # pair 1: policy equals the reference: r_w = r_l = 0, loss = log 2
    policy_chosen = torch.tensor([-5.0, -3.0])
    policy_rejected = torch.tensor([-9.0, -4.0])
    reference_chosen = torch.tensor([-6.0, -3.0])
    reference_rejected = torch.tensor([-7.0, -4.0])
    loss, chosen_rewards, rejected_rewards = dpo_loss(
        policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta=0.5
    )
    torch.testing.assert_close(loss, torch.tensor([math.log1p(math.exp(-1.5)), math.log(2)]))
    torch.testing.assert_close(chosen_rewards, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(rejected_rewards, torch.tensor([-1.0, 0.0]))


def test_dpo_loss_gradient_and_relation_to_the_pairwise_loss():
    policy_chosen = torch.tensor([-5.0], requires_grad=True)
    policy_rejected = torch.tensor([-9.0], requires_grad=True)
    loss, chosen_rewards, rejected_rewards = dpo_loss(
        policy_chosen, policy_rejected, torch.tensor([-6.0]), torch.tensor([-7.0]), beta=0.5
    )
    # DPO is the pairwise loss of its implicit rewards
    torch.testing.assert_close(loss.detach(), pairwise_loss(chosen_rewards, rejected_rewards))
    assert not chosen_rewards.requires_grad  # logged values carry no graph
    loss.sum().backward()
    # d loss / d log π(y_w) = −β (1 − σ(1.5)) = −0.5 · 0.182426
    expected = -0.5 * (1 - 1 / (1 + math.exp(-1.5)))
    torch.testing.assert_close(policy_chosen.grad, torch.tensor([expected]))
    torch.testing.assert_close(policy_rejected.grad, torch.tensor([-expected]))


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(*[torch.zeros(2)] * 4, beta=0.0)
    with pytest.raises(ValueError, match="shapes"):
        pairwise_loss(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="1-D"):
        pairwise_loss(torch.zeros(2, 1), torch.zeros(2, 1))
