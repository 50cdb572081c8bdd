"""Advantage estimators: group-relative (GRPO, Dr. GRPO, RLOO), returns and GAE, whitening.

Conventions: `rewards` for group estimators is `(batch,)` with groups stored as contiguous
blocks of `group_size` (prompt 0's completions first, then prompt 1's, ...). Token-level
tensors are `(batch, seq)` with a `mask` that is 1 on valid steps and 0 on padding; padding
is on the right, so a 0 in the mask ends the sequence. The functions that walk a row in time
(returns, GAE, token-level rewards) check this and name the first row with a hole.
"""

from __future__ import annotations

import torch

from polo.core.distributed import all_reduce_sum
from polo.core.registry import AdvantageInputs, register_advantage


def check_right_padded(mask: torch.Tensor, caller: str) -> None:
    """Raise ValueError naming the first row of `mask` `(batch, T)` that has a 0 followed by a 1.

    The time-walking functions below read the first 0 as the end of the sequence: a hole would
    silently cut the row in two (returns and GAE restart after it, the reward lands on the wrong
    token), so it is refused rather than guessed at.
    """
    is_valid = mask.bool()
    holes = (is_valid[:, 1:] & ~is_valid[:, :-1]).any(-1)
    if holes.any():
        row = int(holes.nonzero()[0, 0])
        positions = is_valid[row].nonzero().squeeze(-1).tolist()
        raise ValueError(
            f"{caller}: mask row {row} is not right-padded (a 0 followed by a 1; valid positions "
            f"{_span_text(positions)}); every row must be its valid steps first, then padding"
        )


def _span_text(positions: list[int]) -> str:
    """Return sorted positions as runs, e.g. [0, 1, 2, 5, 6] -> "0-2, 5-6"."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and position == runs[-1][1] + 1:
            runs[-1][1] = position
        else:
            runs.append([position, position])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Return `rewards` viewed as `(num_groups, group_size)`, after checking the shapes."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (batch,), got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"batch size {rewards.numel()} is not divisible by group_size {group_size}; a batch must hold whole groups"
        )
    return rewards.reshape(-1, group_size)


def zero_spread_groups(rewards: torch.Tensor, group_size: int, atol: float = 0.0) -> torch.Tensor:
    """Return a bool mask `(num_groups,)`, True where every reward in the group is equal.

    A group is "zero spread" when max(r) − min(r) ≤ atol; such groups carry no
    group-relative learning signal.
    """
    grouped = _grouped(rewards, group_size)
    spread = grouped.max(dim=1).values - grouped.min(dim=1).values
    return spread <= atol


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_by_std: bool = True,
    eps: float = 1e-4,
    batch_std: bool = False,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return GRPO group-relative advantages `(batch,)`.

        A_i = (r_i − mean_g(r)) / (std_g(r) + eps)      (scale_by_std=True, GRPO)
        A_i = (r_i − mean_g(r)) / (std_B(r) + eps)      (scale_by_std=True, batch_std=True: Lite PPO)
        A_i =  r_i − mean_g(r)                          (scale_by_std=False, Dr. GRPO)

    mean_g and std_g run over the contiguous group of `group_size` rewards that holds i; std_B over
    every reward of the batch on every rank (`all_reduce_sum`), which keeps the group's baseline but
    no longer rescales each group by its own spread (Liu et al. 2025, "Tricks or Traps?", arXiv
    2508.08221). Both stds are unbiased sample standard deviations (Bessel's correction, divide by
    the count − 1), as `torch.std`'s default. A group whose rewards are all equal gets exactly zero
    advantages (rounding in the mean would otherwise leave tiny values scaled up by 1/eps),
    and so does a group of one.

    `scored` (batch,) bool, when given, marks the completions some reward applied to: the others
    are left out of their group's mean and std and get advantage 0, as TRL's GRPOTrainer treats a
    completion every reward function returned None for (`scored_group_advantages`; its std is the
    group's, also under `batch_std`).

    Shapes: rewards (batch,) → advantages (batch,).
    """
    if scored is not None:
        return scored_group_advantages(rewards, scored, group_size, scale_by_std, eps)
    grouped = _grouped(rewards, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std and batch_std:
        advantages = advantages / (_batch_std(rewards) + eps)
    elif scale_by_std and group_size > 1:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    flat_groups = zero_spread_groups(rewards, group_size).unsqueeze(1)
    return torch.where(flat_groups, 0.0, advantages).reshape(-1)


def _batch_std(rewards: torch.Tensor) -> torch.Tensor:
    """Return the unbiased standard deviation of every reward on every rank (0 for a single reward)."""
    return _batch_moments(rewards, torch.ones_like(rewards, dtype=torch.bool))[1]


def _batch_moments(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the mean and the unbiased standard deviation of `values[valid]` over every rank (std 0 for one value)."""
    kept = torch.where(valid, values, 0.0)
    totals = all_reduce_sum(torch.stack([kept.sum(), valid.sum().to(values.dtype)]))
    count, mean = totals[1], totals[0] / totals[1].clamp(min=1.0)
    squares = all_reduce_sum(torch.where(valid, (values - mean) ** 2, 0.0).sum())
    std = torch.sqrt(squares / (count - 1).clamp(min=1.0)) if count > 1 else torch.zeros_like(mean)
    return mean, std


def decoupled_group_advantages(
    reward_columns: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    eps: float = 1e-4,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return GDPO's advantages `(batch,)`: each reward normalised in its group, the weighted sum normalised over
    the batch.

        Â_ik = (r_ik − mean_g(r_k)) / (std_g(r_k) + eps)       for each reward k, over i's group (as GRPO's)
        s_i  = Σ_k w_k Â_ik
        A_i  = (s_i − mean_B(s)) / (std_B(s) + eps)             over the batch, every rank

    Normalising the sum of the rewards (GRPO) lets a reward with a wide spread drown the others, and maps
    different combinations of rewards to the same advantage; normalising each reward first keeps each one's
    ranking within the group, and the batch normalisation keeps the sum's scale fixed however many rewards there
    are (GDPO, arXiv 2601.05242; TRL's `multi_objective_aggregation="normalize_then_sum"`). A reward that does not
    apply to a completion (NaN: a TRL-form reward's None) is left out of its group's statistics and adds 0 to
    s_i; a group in which a reward is constant gets 0 from that reward (`scored_group_advantages`). `scored`
    (batch,) bool marks the completions some reward applied to: the others get advantage 0 and are left out of the
    batch statistics. The stds are unbiased (divide by count − 1), as `group_advantages`'.
    Shapes: reward_columns (batch, K), weights (K,), scored (batch,) → advantages (batch,).
    """
    if reward_columns.dim() != 2 or weights.shape != reward_columns.shape[1:]:
        raise ValueError(
            f"reward_columns must be (batch, K) and weights (K,), got {tuple(reward_columns.shape)} and "
            f"{tuple(weights.shape)}"
        )
    per_reward = [
        scored_group_advantages(column, ~column.isnan(), group_size, True, eps) for column in reward_columns.T
    ]
    summed = (torch.stack(per_reward, dim=1) * weights.to(reward_columns.dtype)).sum(dim=1)
    valid = scored if scored is not None else torch.ones_like(summed, dtype=torch.bool)
    mean, std = _batch_moments(summed, valid)
    return torch.where(valid, (summed - mean) / (std + eps), 0.0)


def scored_group_advantages(
    rewards: torch.Tensor, scored: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Return `group_advantages` over the scored completions of each group only, 0 for the others `(batch,)`.

        A_i = (r_i − mean_{j∈S} r_j) / (std_{j∈S} r + eps)   for i ∈ S, the group's scored completions
        A_i = 0                                              for i ∉ S

    std_S is the sample standard deviation over S (divide by |S| − 1); a group with fewer than two
    scored completions, or whose scored rewards are all equal, gets zero advantages.

    Shapes: rewards (batch,), scored (batch,) bool → advantages (batch,).
    """
    grouped, mask = _grouped(rewards, group_size), _grouped(scored, group_size)
    count = mask.sum(dim=1, keepdim=True)
    mean = torch.where(mask, grouped, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    advantages = torch.where(mask, grouped - mean, 0.0)
    if scale_by_std:
        std = (advantages.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        advantages = advantages / (std + eps)
    high = torch.where(mask, grouped, -torch.inf).max(dim=1, keepdim=True).values
    low = torch.where(mask, grouped, torch.inf).min(dim=1, keepdim=True).values
    flat = (count < 2) | (high <= low)
    return torch.where(flat | ~mask, 0.0, advantages).reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Return REINFORCE-leave-one-out advantages `(batch,)`.

        A_i = r_i − (1 / (G − 1)) Σ_{j≠i} r_j

    The baseline for sample i is the mean of the *other* G − 1 rewards in its group, so it
    is independent of the sample and the gradient estimate stays unbiased.

    Shapes: rewards (batch,) → advantages (batch,).
    """
    if group_size < 2:
        raise ValueError(f"rloo_advantages needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    grouped = _grouped(rewards, group_size)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return the discounted reward-to-go `(batch, T)`.

        G_t = r_t + γ G_{t+1},  with G = 0 after the last valid step and at padding.

    Shapes: rewards (batch, T), mask (batch, T) → returns (batch, T).
    """
    check_right_padded(mask, "discounted_returns")
    is_valid = mask.bool()
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(is_valid[:, t], rewards[:, t] + gamma * running, 0.0)
        returns[:, t] = running
    return returns


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    last_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (advantages, returns), both `(batch, T)`, by generalised advantage estimation.

        δ_t = r_t + γ V_{t+1} − V_t
        A_t = δ_t + γλ A_{t+1}
        R_t = A_t + V_t          (the value target)

    V_{t+1} after the last valid step is `last_value` (a bootstrap for a truncated episode)
    or 0 (a finished episode). λ = 1 gives the Monte-Carlo return minus V; λ = 0 gives the
    one-step TD error. Advantages and returns are 0 at padding.

    Shapes: rewards, values, mask (batch, T); last_value (batch,) or None.
    """
    check_right_padded(mask, "gae_advantages")
    is_valid = mask.bool()
    bootstrap = torch.zeros_like(values[:, 0]) if last_value is None else last_value.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_advantage = torch.zeros_like(values[:, 0])
    next_value = bootstrap
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(is_valid[:, t], delta + gamma * lam * next_advantage, 0.0)
        advantages[:, t] = next_advantage
        # Step t−1 sees V_t if step t is valid, else it was the last valid step and bootstraps.
        next_value = torch.where(is_valid[:, t], values[:, t], bootstrap)
    returns = torch.where(is_valid, advantages + values, 0.0)
    return advantages, returns


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Return `values` normalised to zero mean and unit variance over the valid entries.

        ŷ = (y − μ) / sqrt(σ² + eps)          (shift_mean=True)
        ŷ = (y − μ) / sqrt(σ² + eps) + μ      (shift_mean=False: rescale, keep the mean)

    μ and σ² (population variance, divide by N) are computed over every valid entry of the
    whole batch on every rank, via `all_reduce_sum`, so data-parallel training whitens with
    the same statistics as one process would. Padding stays 0.

    Shapes: values (batch, seq), mask (batch, seq) → (batch, seq).
    """
    is_valid = mask.bool()
    # torch.where rather than multiplying by the mask, so NaN or inf in padding cannot leak.
    valid_values = torch.where(is_valid, values, 0.0)
    totals = all_reduce_sum(torch.stack([valid_values.sum(), is_valid.sum().to(values.dtype)]))
    count = totals[1].clamp(min=1.0)
    mean = totals[0] / count
    variance = all_reduce_sum(torch.where(is_valid, (values - mean) ** 2, 0.0).sum()) / count
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(is_valid, whitened, 0.0)


def expand_to_tokens(sequence_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return a per-sequence value copied onto every valid token `(batch, seq)`, 0 at padding.

    Shapes: sequence_values (batch,), mask (batch, seq) → (batch, seq).
    """
    if sequence_values.dim() != 1 or sequence_values.shape[0] != mask.shape[0]:
        raise ValueError(
            f"sequence_values must be (batch,) = ({mask.shape[0]},), got shape {tuple(sequence_values.shape)}"
        )
    return torch.where(mask.bool(), sequence_values.unsqueeze(-1), 0.0)


def informative_rows(rewards: torch.Tensor, group_size: int, atol: float = 0.0) -> torch.Tensor:
    """Return the row indices `(kept,)` of every group whose rewards are not all equal (DAPO's filter).

    Dynamic sampling trains only on these rows: a zero-spread group has zero group-relative
    advantage for every member, so it adds nothing but a smaller effective batch.
    Shapes: rewards (batch,) → long indices (kept,), whole groups in their original order.
    """
    keep_group = ~zero_spread_groups(rewards, group_size, atol)
    return keep_group.repeat_interleave(group_size).nonzero().squeeze(-1)


def token_level_rewards(
    sequence_rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, beta: float = 0.0
) -> torch.Tensor:
    """Return per-token rewards `(batch, T)`: the sequence reward on the last valid token, −β·KL on every token.

        r_t = −β · KL_t + [t = last valid token] · R

    This is the reward of PPO for language models (Ziegler et al. 2019; Ouyang et al. 2022)
    and of REINFORCE++: the KL to the reference is a per-token penalty in the reward rather
    than a term of the loss. A row with no valid token gets no reward.
    Shapes: sequence_rewards (batch,), mask (batch, T), kl (batch, T) or None → (batch, T).
    """
    check_right_padded(mask, "token_level_rewards")
    is_valid = mask.bool()
    lengths = is_valid.sum(-1)
    last = (lengths - 1).clamp(min=0)
    rewards = torch.zeros(mask.shape, dtype=sequence_rewards.dtype, device=mask.device)
    rewards[torch.arange(mask.shape[0], device=mask.device), last] = torch.where(lengths > 0, sequence_rewards, 0.0)
    if kl is not None and beta:
        rewards = rewards - beta * kl.to(rewards.dtype)
    return torch.where(is_valid, rewards, 0.0)


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Return REINFORCE++ advantages `(batch, T)`: reward-to-go whitened over the whole batch.

        G_t = Σ_{k ≥ t} γ^{k−t} r_k,      A_t = (G_t − mean(G)) / std(G)

    mean and std run over every valid token of the global batch (all ranks): the batch, not
    a group or a critic, is the baseline (Hu 2025, "REINFORCE++").
    Shapes: token_rewards, mask (batch, T) → (batch, T), 0 at padding.
    """
    check_right_padded(mask, "reinforce_pp_advantages")
    return whiten(discounted_returns(token_rewards, mask, gamma), mask)


def explained_variance(predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> float:
    """Return 1 − Var(target − predicted) / Var(target) over valid entries (1 is perfect, ≤ 0 is useless).

    Shapes: predicted, target, mask (batch, T).
    """
    is_valid = mask.bool()
    target_valid, residual = target[is_valid], (target - predicted)[is_valid]
    if target_valid.numel() < 2:
        return float("nan")
    variance = target_valid.var(unbiased=False)
    return float("nan") if variance == 0 else float(1.0 - residual.var(unbiased=False) / variance)


# The registered estimators: each turns one batch of whole groups into per-token advantages
# (batch, seq) (+ value targets for a critic), reading its knobs from `settings` (the recipe's
# `algorithm` section: scale_rewards, advantage_eps, beta, gamma, lam).


@register_advantage("grpo", help="group-relative (Shao et al. 2024)")
def grpo_estimator(inputs: AdvantageInputs, settings) -> tuple[torch.Tensor, None]:
    """Return GRPO's (r_i − mean_G r) / (std_G r + ε) on every token of completion i (Dr. GRPO: no std; Lite PPO:
    the batch's std, `scale_rewards: batch`)."""
    advantages = group_advantages(
        inputs.rewards,
        inputs.group_size,
        scale_by_std=bool(settings.scale_rewards),
        eps=settings.advantage_eps,
        batch_std=settings.scale_rewards == "batch",
        scored=inputs.scored,
    )
    return expand_to_tokens(advantages, inputs.mask), None


@register_advantage("rloo", help="leave-one-out baseline (Kool et al. 2019)")
def rloo_estimator(inputs: AdvantageInputs, settings) -> tuple[torch.Tensor, None]:
    """Return RLOO's r_i − mean of the other G − 1 rewards on every token of completion i."""
    return expand_to_tokens(rloo_advantages(inputs.rewards, inputs.group_size), inputs.mask), None


@register_advantage("reinforce_pp", token_level=True, help="batch-whitened returns (Hu 2025)")
def reinforce_pp_estimator(inputs: AdvantageInputs, settings) -> tuple[torch.Tensor, None]:
    """Return REINFORCE++'s batch-whitened reward-to-go of the per-token rewards (KL folded in)."""
    token_rewards = token_level_rewards(inputs.rewards, inputs.mask, inputs.kl, settings.beta)
    return reinforce_pp_advantages(token_rewards, inputs.mask, settings.gamma), None


@register_advantage("gae", needs_critic=True, token_level=True, help="a critic (Schulman et al. 2016)")
def gae_estimator(inputs: AdvantageInputs, settings) -> tuple[torch.Tensor, torch.Tensor]:
    """Return PPO's whitened GAE(γ, λ) advantages of the per-token rewards and the returns the critic regresses to."""
    if inputs.values is None:
        raise ValueError("the gae estimator needs critic values (AdvantageInputs.values)")
    token_rewards = token_level_rewards(inputs.rewards, inputs.mask, inputs.kl, settings.beta)
    advantages, returns = gae_advantages(token_rewards, inputs.values, inputs.mask, settings.gamma, settings.lam)
    return whiten(advantages, inputs.mask), returns


@register_advantage(
    "gdpo", help="each reward normalised in its group, the weighted sum over the batch (GDPO, arXiv 2601.05242)"
)
def gdpo_estimator(inputs: AdvantageInputs, settings) -> tuple[torch.Tensor, None]:
    """Return GDPO's `decoupled_group_advantages` of the rewards' own columns on every token of completion i.

    It normalises by the std by construction, so `scale_rewards` is not read; `advantage_eps` is its ε."""
    if inputs.reward_columns is None or inputs.reward_weights is None:
        raise ValueError("the gdpo estimator needs each reward's column (AdvantageInputs.reward_columns and weights)")
    advantages = decoupled_group_advantages(
        inputs.reward_columns, inputs.reward_weights, inputs.group_size, settings.advantage_eps, inputs.scored
    )
    return expand_to_tokens(advantages, inputs.mask), None
