"""Per-token estimators of KL(π ‖ π_ref) from tokens sampled from π (Schulman, 2020).

With r = π_ref(y) / π(y) and y ~ π:
    k1 = −log r                 unbiased, high variance, can be negative per token
    k2 = ½ (log r)²             biased, low variance, ≥ 0
    k3 = (r − 1) − log r        unbiased, low variance, ≥ 0
All take log-probabilities of the sampled tokens, shapes `(batch, seq)`, and return
`(batch, seq)`; masking and averaging are left to `polo.core.losses.aggregate_loss`.
"""

from __future__ import annotations

import torch

from polo.core.registry import KL_ESTIMATORS, register_kl

# exp(20) ≈ 4.9e8 is finite in fp16/bf16/fp32 alike, while an unclamped exp overflows to inf
# (fp32 past ~88, fp16 past ~11) the first time the policy drifts far from the reference on a
# single token, and one inf poisons the whole loss and its gradients. Only the upper side needs
# a limit: below it exp(d) merely underflows to 0, which is the right value.
K3_LOG_RATIO_LIMIT = 20.0


@register_kl("k1", help="log π − log π_ref")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Return the k1 estimate `(batch, seq)`: log π(y) − log π_ref(y)."""
    return logprobs - ref_logprobs


@register_kl("k2", help="(log π − log π_ref)²/2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Return the k2 estimate `(batch, seq)`: ½ (log π(y) − log π_ref(y))²."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register_kl("k3", help="r − 1 − log r with r = π_ref/π (unbiased and always ≥ 0)")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Return the k3 estimate `(batch, seq)`: exp(d) − d − 1 with d = log π_ref(y) − log π(y).

    Always ≥ 0 (since eˣ ≥ 1 + x) and exactly 0 where the two log-probs agree. d is clamped
    above at K3_LOG_RATIO_LIMIT so the exponential stays finite; above the clamp the gradient
    is zero, which only matters on tokens the reference finds e²⁰ times likelier than the policy.
    Below there is no clamp: as d → −∞ the estimate tends to −d − 1 and its gradient with respect
    to log π(y) to 1 − e^d → 1, the push back towards the reference that a clamp would remove.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(max=K3_LOG_RATIO_LIMIT)
    # Written as expm1(d) − d: for small d, exp(d) rounds to 1 + d + (an error as large as the
    # d²/2 we want), so exp(d) − d − 1 comes out slightly negative (−6e-8 in fp32). expm1 keeps
    # the d²/2 term, and expm1(d) ≥ d holds in floating point too, so the result stays ≥ 0.
    return torch.expm1(log_ratio) - log_ratio


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Return the per-token KL estimate `(batch, seq)` of the registered kind ("k1", "k2", "k3", ...)."""
    return KL_ESTIMATORS[kind](logprobs, ref_logprobs)
