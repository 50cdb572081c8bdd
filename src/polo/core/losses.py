"""Policy and value losses per token, and the one function that decides "mean over what".

Every loss here returns a per-token tensor `(batch, seq)` that is 0 at padding; turning it
into the scalar to backpropagate is the job of `aggregate_loss` alone. Padding is removed
with `torch.where` rather than by multiplying with the mask, so NaN or inf at padded
positions reaches neither the loss nor the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polo.core.fields import setting
from polo.core.registry import (
    LOSS_AGGREGATIONS,
    LossNormalisers,
    PolicyLossInputs,
    register_aggregation,
    register_policy_loss,
)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Return the sum of `values` over valid positions (all of them, or along `dim`)."""
    valid_values = torch.where(mask.bool(), values, 0.0)
    return valid_values.sum() if dim is None else valid_values.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Return the mean of `values` over valid positions; 0 where there are none.

    This is a local mean (this process, this micro-batch), meant for metrics and per-sequence
    averages; batch-spanning normalisers belong to `aggregate_loss`.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def _token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return advantages shaped to broadcast over `(batch, seq)`."""
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        return advantages.unsqueeze(-1)
    if advantages.shape == mask.shape:
        return advantages
    raise ValueError(
        f"advantages must be (batch,) = ({mask.shape[0]},) or (batch, seq) = {tuple(mask.shape)}, "
        f"got shape {tuple(advantages.shape)}"
    )


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return the per-token clipped-surrogate loss and its clip counts (shared by PPO and GSPO).

    With `delta`, the unclipped term's ratio is capped at δ as well (INTELLECT-2's two-sided clipping).
    """
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if delta is not None and not delta > 1.0:
        raise ValueError(f"delta caps the ratio and must be > 1 (or None), got {delta}")
    is_valid = mask.bool()
    unclipped = (ratio if delta is None else ratio.clamp(max=delta)) * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    per_token = torch.where(is_valid, -torch.minimum(unclipped, clipped), 0.0)
    with torch.no_grad():
        stats = {
            "clip_low_count": (is_valid & (ratio < 1.0 - eps_low) & (advantages < 0)).sum().float(),
            "clip_high_count": (is_valid & (ratio > 1.0 + eps_high) & (advantages > 0)).sum().float(),
            "ratio_sum": masked_sum(ratio, is_valid).float(),
            "token_count": is_valid.sum().float(),
        }
    return per_token, stats


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (per-token PPO-clip loss `(batch, seq)`, stats) — PPO, DAPO's clip-higher, INTELLECT-2's two sides.

        ρ_t = exp(log π(y_t) − log π_old(y_t))
        l_t = −min(ρ_t A_t, clip(ρ_t, 1 − eps_low, 1 + eps_high) A_t)
        l_t = −min(min(ρ_t, δ) A_t, clip(ρ_t, 1 − eps_low, 1 + eps_high) A_t)      (with `delta` δ)

    eps_low = eps_high is classic PPO; eps_high > eps_low is clip-higher (DAPO). With A_t < 0 the min picks the
    unclipped ρ_t A_t, which grows without bound as ρ_t does; δ (> 1 + eps_high) bounds it: two-sided clipping
    (Prime Intellect 2025, INTELLECT-2, arXiv 2505.07291).
    Shapes: logprobs, old_logprobs, mask (batch, seq); advantages (batch,) — one per
    sequence, broadcast to its tokens — or (batch, seq).

    Stats are detached float sums so the trainer can add them up across micro-batches and
    ranks before dividing: `clip_low_count` (valid tokens with ρ < 1 − eps_low and A < 0),
    `clip_high_count` (ρ > 1 + eps_high and A > 0), `ratio_sum` and `token_count`; e.g.
    clip_high_fraction = Σ clip_high_count / Σ token_count.
    """
    is_valid = mask.bool()
    # Zeroing the log-ratio before exp keeps padding out of the backward pass as well.
    ratio = torch.exp(torch.where(is_valid, logprobs - old_logprobs, 0.0))
    return _clipped_surrogate(ratio, _token_advantages(advantages, mask), is_valid, eps_low, eps_high, delta)


def _with_clip_range(loss, inputs: PolicyLossInputs, settings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return `loss` (`ppo_clip_loss` or `gspo_loss`) of a micro-batch with the recipe's clip range, low and high,
    and its two-sided cap `clip_delta`."""
    return loss(
        inputs.logprobs,
        inputs.old_logprobs,
        inputs.advantages,
        inputs.mask,
        settings.clip_eps_low,
        settings.clip_eps_high,
        settings.clip_delta,
    )


@register_policy_loss("ppo_clip", help="PPO's clipped surrogate on the token ratio")
def ppo_clip_policy_loss(inputs: PolicyLossInputs, settings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return `ppo_clip_loss` of a micro-batch with the recipe's clip range (`clip_eps_low`, `clip_eps_high`)."""
    return _with_clip_range(ppo_clip_loss, inputs, settings)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (per-token GSPO loss `(batch, seq)`, stats), with one importance ratio per sequence.

        s_i = exp( (1/|y_i|) Σ_t (log π(y_it) − log π_old(y_it)) )      (over valid tokens)
        L_i = −min(s_i A_i, clip(s_i, 1 − eps_low, 1 + eps_high) A_i)
        (with `delta` δ, s_i in the first term is min(s_i, δ), as in `ppo_clip_loss`)

    L_i is written on every valid token of sequence i, so the `seq_mean_token_mean` aggregation
    gives exactly the sequence-level objective mean_i L_i.
    Shapes: logprobs, old_logprobs, mask (batch, seq); advantages (batch,), or (batch, seq)
    reduced to its per-sequence masked mean (exact for a broadcast sequence advantage).
    Stats are as for `ppo_clip_loss`, counting every valid token of a clipped sequence.
    """
    is_valid = mask.bool()
    log_ratio = torch.where(is_valid, logprobs - old_logprobs, 0.0)
    sequence_ratio = torch.exp(masked_mean(log_ratio, is_valid, dim=-1))
    token_advantages = _token_advantages(advantages, mask)
    if token_advantages.shape == mask.shape:
        token_advantages = masked_mean(token_advantages, is_valid, dim=-1).unsqueeze(-1)
    ratio = sequence_ratio.unsqueeze(-1).expand_as(logprobs)
    return _clipped_surrogate(ratio, token_advantages, is_valid, eps_low, eps_high, delta)


@register_policy_loss("gspo", help="the same on the length-normalised sequence ratio (Zheng et al. 2025)")
def gspo_policy_loss(inputs: PolicyLossInputs, settings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return `gspo_loss` of a micro-batch with the recipe's clip range (`clip_eps_low`, `clip_eps_high`)."""
    return _with_clip_range(gspo_loss, inputs, settings)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    max_ratio: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (per-token CISPO loss `(batch, seq)`, stats): the importance weight is clipped, not the update.

        ρ_t = exp(log π(y_t) − log π_old(y_t))
        l_t = −sg(min(ρ_t, max_ratio)) A_t log π(y_t)          (sg: no gradient through the weight)

    PPO's clip drops the gradient of a clipped token altogether; CISPO keeps every token's REINFORCE gradient
    A_t ∇log π(y_t) and only bounds its weight (MiniMax 2025, MiniMax-M1, arXiv 2506.13585). The paper's
    weight is clip(ρ_t, 1 − ε_low, 1 + ε_high) and it sets no lower bound in practice; polo takes that reading,
    an upper cap alone, as ScaleRL's ε_max does (Khatri et al. 2025, arXiv 2510.13786: ε_max = 5).
    Shapes: logprobs, old_logprobs, mask (batch, seq); advantages (batch,) or (batch, seq).
    Stats as for `ppo_clip_loss`: `clip_high_count` counts the tokens whose weight was capped with A > 0.
    """
    if not max_ratio > 1.0:
        raise ValueError(f"max_ratio caps the importance weight and must be > 1, got {max_ratio}")
    is_valid = mask.bool()
    token_advantages = _token_advantages(advantages, mask)
    with torch.no_grad():
        ratio = torch.exp(torch.where(is_valid, logprobs - old_logprobs, 0.0))
        weight = ratio.clamp(max=max_ratio)
        stats = {
            "clip_low_count": torch.zeros((), device=ratio.device),
            "clip_high_count": (is_valid & (ratio > max_ratio) & (token_advantages > 0)).sum().float(),
            "ratio_sum": masked_sum(ratio, is_valid).float(),
            "token_count": is_valid.sum().float(),
        }
    per_token = torch.where(is_valid, -weight * token_advantages * logprobs, 0.0)
    return per_token, stats


@register_policy_loss(
    "cispo", help="REINFORCE with the ratio as a weight capped at 1 + clip_eps_high (MiniMax-M1, MiniMax 2025)"
)
def cispo_policy_loss(inputs: PolicyLossInputs, settings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return `cispo_loss` of a micro-batch with its weight capped at 1 + `clip_eps_high` (`clip_eps_low` unused)."""
    return cispo_loss(
        inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, 1.0 + settings.clip_eps_high
    )


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    temperature_pos: float,
    temperature_neg: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (per-token SAPO loss `(batch, seq)`, stats): a smooth gate on the ratio instead of a hard clip.

        ρ_t = exp(log π(y_t) − log π_old(y_t)),   τ_t = temperature_pos if A_t > 0 else temperature_neg
        l_t = −(4 / τ_t) σ(τ_t (ρ_t − 1)) A_t

    At ρ = 1 its gradient is PPO's (∂l/∂ρ = −4σ(1 − σ) A = −A); away from 1 the weight 4σ(1 − σ) decays smoothly
    rather than dropping to 0 at the clip edge, faster for negative advantages when τ_neg > τ_pos (Qwen 2025, SAPO,
    arXiv 2511.20347; its defaults τ_pos = 1, τ_neg = 1.05 are TRL's). The ratio is the token's.
    Shapes: logprobs, old_logprobs, mask (batch, seq); advantages (batch,) or (batch, seq).
    Stats: `ratio_sum` and `token_count` (nothing is clipped).
    """
    if not (temperature_pos > 0 and temperature_neg > 0):
        raise ValueError(f"SAPO's temperatures must be > 0, got {temperature_pos} and {temperature_neg}")
    is_valid = mask.bool()
    token_advantages = _token_advantages(advantages, mask)
    ratio = torch.exp(torch.where(is_valid, logprobs - old_logprobs, 0.0))
    temperature = torch.where(token_advantages > 0, temperature_pos, temperature_neg)
    gate = torch.sigmoid(temperature * (ratio - 1.0)) * 4.0 / temperature
    per_token = torch.where(is_valid, -gate * token_advantages, 0.0)
    with torch.no_grad():
        stats = {"ratio_sum": masked_sum(ratio, is_valid).float(), "token_count": is_valid.sum().float()}
    return per_token, stats


@register_policy_loss("sapo", help="a smooth sigmoid gate on the ratio instead of a hard clip (SAPO, Qwen 2025)")
def sapo_policy_loss(inputs: PolicyLossInputs, settings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return `sapo_loss` of a micro-batch with the recipe's `sapo_temperature_pos` and `sapo_temperature_neg`."""
    return sapo_loss(
        inputs.logprobs,
        inputs.old_logprobs,
        inputs.advantages,
        inputs.mask,
        settings.sapo_temperature_pos,
        settings.sapo_temperature_neg,
    )


@dataclass
class VespoSettings:
    """VESPO's reshaping kernel φ(w) = w^k e^{λ(1 − w)}: one (k, λ) for non-negative advantages, one for negative."""

    k_pos: float = setting(
        2.0,
        help="k of φ for A ≥ 0: the power of w, which takes the weight to 0 as the sequence ratio w → 0",
        range=">= 0",
    )
    lambda_pos: float = setting(
        3.0,
        help="λ of φ for A ≥ 0: the rate of e^{−λw}, which takes it to 0 as w grows (φ peaks at w = k/λ)",
        range="> 0",
    )
    k_neg: float = setting(3.0, help="k of φ for A < 0", range=">= 0")
    lambda_neg: float = setting(2.0, help="λ of φ for A < 0", range="> 0")


def vespo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    options: VespoSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (per-token VESPO loss `(batch, seq)`, stats): REINFORCE weighted by a smooth kernel of the sequence ratio.

        log w_i = Σ_t (log π(y_it) − log π_old(y_it))            (over valid tokens; no 1/|y_i|)
        φ(w)   = w^k e^{λ (1 − w)} = exp(λ + k log w − λ w)       (k, λ: k_pos, λ_pos if A ≥ 0, else k_neg, λ_neg)
        l_it   = −sg(φ(w_i)) A_it log π(y_it)                    (sg: no gradient through the weight)

    φ(1) = 1, so on-policy it is GRPO's REINFORCE gradient; off-policy the weight rises to its peak at w = k/λ and
    decays smoothly to 0 on both sides instead of being clipped, and nothing is length-normalised (VESPO,
    arXiv 2602.10693, 2026: the closed-form kernel of a variational proposal with variance reduction; its
    defaults k = 2, λ = 3 for positive advantages and k = 3, λ = 2 for negative are TRL's). The paper leaves the
    aggregation to the trainer; the `vespo` preset takes a token mean, as TRL does. polo computes φ in log space
    without clamping log w: φ tends to 0 at both ends, where exp underflows to exactly that (TRL clamps log w to
    [log 1e-8, 20], which changes φ only where it is below 1e-14).
    Shapes: logprobs, old_logprobs, mask (batch, seq); advantages (batch,) or (batch, seq).
    Stats: `weight_sum`, the sum of φ over valid tokens, and `token_count` (nothing is clipped).
    """
    is_valid = mask.bool()
    token_advantages = _token_advantages(advantages, mask)
    with torch.no_grad():
        log_weight = masked_sum(logprobs - old_logprobs, is_valid, dim=-1).unsqueeze(-1)
        non_negative = token_advantages >= 0
        k = torch.where(non_negative, options.k_pos, options.k_neg)
        lam = torch.where(non_negative, options.lambda_pos, options.lambda_neg)
        weight = torch.exp(lam + k * log_weight - lam * torch.exp(log_weight))
        stats = {
            "weight_sum": masked_sum(weight.expand_as(logprobs), is_valid).float(),
            "token_count": is_valid.sum().float(),
        }
    per_token = torch.where(is_valid, -weight * token_advantages * logprobs, 0.0)
    return per_token, stats


@register_policy_loss(
    "vespo",
    settings=VespoSettings,
    help="REINFORCE weighted by a smooth gamma kernel of the unnormalised sequence ratio (VESPO, 2026)",
)
def vespo_policy_loss(
    inputs: PolicyLossInputs, settings, options: VespoSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return `vespo_loss` of a micro-batch with its kernel's `algorithm.policy_loss_options` (k, λ per sign)."""
    return vespo_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, options)


SAMPLER_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_correction_weights(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Return the importance weights that correct for the sampler's numerics, `(batch, seq)` or `(batch, 1)`.

        c_t = π_old(y_t) / μ(y_t) = exp(log π_old(y_t) − log μ(y_t))        (token_*)
        c_i = Π_t c_t = exp(Σ_t (log π_old(y_it) − log μ(y_it)))              (sequence_*: one per completion)
        *_truncate: c ← clip(c, low, high)       *_mask: c ← 0 where c < low or c > high

    μ is the sampler: the same weights as π_old, but its own forward (a KV cache, other kernels, another precision)
    gives slightly other probabilities, so the tokens were drawn from μ and every policy loss, which takes them as
    drawn from π_old, gets them weighted by c (truncated importance sampling, TIS: Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"; its masked form, MIS; TRL's
    `vllm_importance_sampling_*`). A missing bound (None) is no bound. A log-prob the sampler could not give (NaN)
    counts as no correction. The weights carry no gradient.
    Shapes: old_logprobs, sampling_logprobs, mask (batch, seq) → (batch, seq) (token_*) or (batch, 1) (sequence_*).
    """
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"sampler correction mode {mode!r} is not one of {', '.join(SAMPLER_CORRECTIONS)}")
    log_ratio = torch.nan_to_num(torch.where(mask.bool(), old_logprobs - sampling_logprobs, 0.0), nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    weights = torch.exp(log_ratio.detach())
    if mode.endswith("truncate"):
        return weights.clamp(min=low, max=high)
    outside = torch.zeros_like(weights, dtype=torch.bool)
    if low is not None:
        outside |= weights < low
    if high is not None:
        outside |= weights > high
    return weights.masked_fill(outside, 0.0)


def off_policy_sequences(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Return a bool mask `(batch, 1)` (or `(batch, seq)` for per-token advantages) of the completions to keep.

        KL_i = (1/|y_i|) Σ_t (log μ(y_it) − log π(y_it))       (the sampled completion's drift, over valid tokens)
        keep_i = A_i ≥ 0  or  KL_i ≤ threshold

    A completion with a negative advantage that the policy has drifted far from is left out of the loss: pushing
    its probability further down teaches little and destabilises training (DeepSeek-AI 2025, DeepSeek-V3.2,
    arXiv 2512.02556, eq. 9, its δ; TRL's `off_policy_mask_threshold`). μ is the sampler's log-probs, or the
    sampling policy's where the sampler gives none; π is the policy being trained, so the mask changes from one
    optimizer step to the next. A NaN log-prob counts as no drift.
    Shapes: logprobs, sampling_logprobs, mask (batch, seq); advantages (batch,) or (batch, seq).
    """
    is_valid = mask.bool()
    drift = torch.nan_to_num(torch.where(is_valid, sampling_logprobs - logprobs.detach(), 0.0), nan=0.0)
    mean_drift = masked_mean(drift, is_valid, dim=-1).unsqueeze(-1)
    return (_token_advantages(advantages, mask) >= 0) | (mean_drift <= threshold)


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Return a bool mask `(batch, seq)` of the valid tokens whose entropy is in the top `quantile` of the valid ones.

        keep_t = m_t ∧ H_t ≥ q,   q = the (1 − quantile) quantile of {H_t : m_t}

    Only the high-entropy "forking" tokens then carry the policy gradient (Wang et al. 2025, "Beyond the 80/20
    Rule", arXiv 2506.01939: quantile 0.2). quantile 1 keeps every valid token. The quantile is taken over the
    tokens given, which the update passes one micro-batch of one rank at a time (TRL pools the ranks' micro-batches;
    in one process the two agree).
    Shapes: entropy, mask (batch, seq) → bool (batch, seq).
    """
    is_valid = mask.bool()
    if quantile >= 1.0 or not is_valid.any():
        return is_valid
    threshold = torch.quantile(entropy[is_valid].float(), 1.0 - quantile)
    return is_valid & (entropy >= threshold.to(entropy.dtype))


def vanilla_pg_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return the per-token REINFORCE loss `(batch, seq)`: l_t = −A_t log π(y_t).

    Its gradient is −A_t ∇ log π(y_t), the policy-gradient theorem's estimator.
    Shapes: logprobs, mask (batch, seq); advantages (batch,) or (batch, seq).
    """
    per_token = -_token_advantages(advantages, mask) * logprobs
    return torch.where(mask.bool(), per_token, 0.0)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None,
) -> torch.Tensor:
    """Return the per-token (optionally clipped) value loss `(batch, seq)`.

        l_t = ½ max((V_t − R_t)², (clip(V_t, V_old,t − c, V_old,t + c) − R_t)²)
        l_t = ½ (V_t − R_t)²                                      (clip_range None)

    Shapes: values, old_values, returns, mask (batch, seq).
    """
    squared_error = (values - returns) ** 2
    if clip_range is not None:
        if clip_range <= 0:
            raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        squared_error = torch.maximum(squared_error, (clipped_values - returns) ** 2)
    return torch.where(mask.bool(), 0.5 * squared_error, 0.0)


def _checked(name: str, value: float) -> float:
    value = float(value)
    if not value > 0:
        raise ValueError(f"{name} must be a positive count for the whole optimizer step, got {value}")
    return value


@register_aggregation("seq_mean_token_mean", help="a mean per sequence, then over sequences (GRPO)")
def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, normalisers: LossNormalisers) -> torch.Tensor:
    """Return each sequence's mean over its tokens, averaged over the step's sequences (GRPO's objective).

        L = Σ_i (Σ_t m_it l_it / Σ_t m_it) / num_sequences

    Every sequence weighs the same, so a token of a short completion weighs more than one of a
    long one (Shao et al. 2024, DeepSeekMath; the length bias Liu et al. 2025 point out).
    Shapes: per_token, mask (batch, seq) → scalar.
    """
    return masked_mean(per_token, mask, dim=-1).sum() / _checked("num_sequences", normalisers.num_sequences)


@register_aggregation("token_mean", help="over all tokens (DAPO)")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, normalisers: LossNormalisers) -> torch.Tensor:
    """Return the mean over every valid token of the optimizer step (DAPO's token-level loss).

        L = Σ_it m_it l_it / num_tokens

    Every token weighs the same, whatever the length of its completion (Yu et al. 2025, DAPO).
    Shapes: per_token, mask (batch, seq) → scalar.
    """
    return masked_sum(per_token, mask) / _checked("num_tokens", normalisers.num_tokens)


@register_aggregation("seq_mean_token_sum_norm", help="sums over a constant (Dr. GRPO)")
def seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, normalisers: LossNormalisers) -> torch.Tensor:
    """Return the sum over valid tokens divided by a constant: sequences times the longest allowed completion.

        L = Σ_it m_it l_it / (num_sequences · max_completion_length)

    The normaliser does not depend on the lengths sampled, so no length is favoured
    (Liu et al. 2025, Dr. GRPO). Shapes: per_token, mask (batch, seq) → scalar.
    """
    normaliser = _checked("num_sequences", normalisers.num_sequences) * _checked(
        "max_completion_length", normalisers.max_completion_length
    )
    return masked_sum(per_token, mask) / normaliser


@register_aggregation("micro_batch_token_mean", help="over each micro-batch's tokens (TRL's bnpo)")
def micro_batch_token_mean(per_token: torch.Tensor, mask: torch.Tensor, normalisers: LossNormalisers) -> torch.Tensor:
    """Return this micro-batch's mean over its own valid tokens, averaged over the step's micro-batches.

        L = (Σ_it m_it l_it / Σ_it m_it) / num_micro_batches          (sums over this micro-batch only)

    TRL's "bnpo": the token count is the local batch's (this micro-batch on this rank), so unlike
    every other aggregation the result depends on `train.micro_batch_size` and the number of
    ranks; with one micro-batch on one rank it equals `token_mean`. A micro-batch without valid
    tokens contributes 0. Shapes: per_token, mask (batch, seq) → scalar.
    """
    local_tokens = mask.float().sum().clamp(min=1.0)
    return masked_sum(per_token, mask) / local_tokens / _checked("num_micro_batches", normalisers.num_micro_batches)


@register_aggregation("seq_mean_token_sum", help="a sum per sequence, then a mean over sequences (LUSPO)")
def seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, normalisers: LossNormalisers) -> torch.Tensor:
    """Return each sequence's sum over its tokens, averaged over the step's sequences (LUSPO's objective).

        L = Σ_i Σ_t m_it l_it / num_sequences

    Under GSPO's loss, which writes a sequence's loss L_i on each of its |y_i| tokens, this is mean_i |y_i| L_i:
    each sequence's loss scaled by its length, which removes the bias of GSPO's sequence mean against long
    completions (Liu et al. 2026, LUSPO, arXiv 2602.05261). Under a token-level loss it is a sequence-mean of sums.
    Shapes: per_token, mask (batch, seq) → scalar.
    """
    return masked_sum(per_token, mask) / _checked("num_sequences", normalisers.num_sequences)


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, normalisers: LossNormalisers
) -> torch.Tensor:
    """Return the scalar loss of this micro-batch under the registered aggregation `mode`.

        seq_mean_token_mean       Σ_i (Σ_t m_it l_it / Σ_t m_it) / num_sequences            (GRPO)
        token_mean                Σ_it m_it l_it / num_tokens                               (DAPO)
        seq_mean_token_sum_norm   Σ_it m_it l_it / (num_sequences · max_completion_length)  (Dr. GRPO)
        micro_batch_token_mean    (Σ_it m_it l_it / Σ_it m_it) / num_micro_batches          (TRL's bnpo)
        seq_mean_token_sum        Σ_it m_it l_it / num_sequences                            (LUSPO)

    The counts in `normalisers` are GLOBAL: for the whole optimizer step, over every
    micro-batch of gradient accumulation and every rank (see
    `polo.core.distributed.global_count`). Each term above is then a plain sum over
    sequences, tokens or micro-batches, so the micro-batch losses add up to exactly the
    full-batch loss and no extra division by the number of micro-batches is needed. The same
    holds across ranks when their gradients are summed; DistributedDataParallel averages them
    instead, so a DDP trainer multiplies this loss by the world size. A sequence with no valid
    tokens contributes 0.

    Shapes: per_token (batch, seq), mask (batch, seq) → scalar.
    """
    return LOSS_AGGREGATIONS[mode](per_token, mask, normalisers)


def entropy_from_logits(logits: torch.Tensor, logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """Return the entropy of softmax(logits) over the last dim, shape `(...)`.

        H = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v,   p = softmax(z)

    Shapes: logits (..., vocab) → (...); `logsumexp` (...) may be passed when the caller has
    it already (the log-prob gather needs it too), saving a full-vocabulary pass.
    """
    if logsumexp is None:
        logsumexp = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - logsumexp.unsqueeze(-1))
    # A −inf logit (a banned token) has p = 0, and 0·(−inf) is NaN in value and gradient:
    # such terms contribute 0.
    finite_logits = torch.where(
        torch.isfinite(logits), logits, torch.zeros((), dtype=logits.dtype, device=logits.device)
    )
    return logsumexp - (probs * finite_logits).sum(dim=-1)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float, normalisers: LossNormalisers) -> torch.Tensor:
    """Return the entropy bonus's term of this micro-batch's loss (Williams & Peng 1991; Mnih et al. 2016; PPO's
    c₂ S[π], Schulman et al. 2017), a scalar:

        L_H = − c · (Σ_t m_t H_t / Σ_t m_t) / num_micro_batches,    H_t = −Σ_v π(v | ·) log π(v | ·)

    Minimising it raises the policy's entropy, so it keeps exploring. polo takes TRL's reading: the mean
    entropy of the tokens `mask` marks, per micro-batch (`micro_batch_token_mean`), whatever the policy
    loss's aggregation, so c means the same for every loss (verl aggregates it as the policy loss instead).
    Shapes: entropy (with a gradient), mask (batch, seq) → scalar.
    """
    return -coef * micro_batch_token_mean(entropy, mask, normalisers)
