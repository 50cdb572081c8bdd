"""Losses that learn from comparisons: the reward model's pairwise loss and DPO.

Both see pairs (y_w, y_l) of responses to one prompt x, y_w preferred, and model the
preference with Bradley-Terry, P(y_w ≻ y_l | x) = σ(r(x, y_w) − r(x, y_l)). They differ only in
what r is: a learned scalar head (reward model), or β times the policy's log-ratio to a frozen
reference (DPO's implicit reward). Every function returns one value per pair; the caller
averages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_pairs(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is 1-D and all have the same length."""
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    lengths = {shape[0] if len(shape) == 1 else None for shape in shapes.values()}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(f"expected 1-D tensors of one length (pairs,), got shapes {shapes}")


def pairwise_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Return the Bradley-Terry reward-model loss per pair, (pairs,).

        loss = −log σ(r_w − r_l)

    (InstructGPT, Ouyang et al. 2022, eq. 1, before the mean over pairs). `chosen_rewards` r_w
    and `rejected_rewards` r_l are the scalar rewards of the preferred and the other response,
    each (pairs,). Computed as softplus(r_l − r_w), which stays finite for any margin.
    """
    _check_pairs(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    return -F.logsigmoid(chosen_rewards - rejected_rewards)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (loss, chosen implicit reward, rejected implicit reward), each (pairs,).

        r_w = β (log π(y_w|x) − log π_ref(y_w|x))        r_l = β (log π(y_l|x) − log π_ref(y_l|x))
        loss = −log σ(r_w − r_l)

    (Direct Preference Optimization, Rafailov et al. 2023, eq. 7.) Every input is the summed
    log-probability of a whole response (its tokens only, never the prompt's), shape (pairs,).
    The implicit rewards are returned detached, for logging: their mean difference is TRL's
    `rewards/margins`, and the fraction with r_w > r_l its `rewards/accuracies`.
    """
    _check_pairs(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        reference_chosen_logps=reference_chosen_logps,
        reference_rejected_logps=reference_rejected_logps,
    )
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (the strength of the KL anchor to the reference), got {beta}")
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps)
    loss = pairwise_loss(chosen_rewards, rejected_rewards)
    return loss, chosen_rewards.detach(), rejected_rewards.detach()
