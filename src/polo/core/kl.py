"""Per-token estimators of KL(π ‖ π_ref) from tokens sampled from π (Schulman, 2020).

With r = π_ref(y) / π(y) and y ~ π:
    k1 = −log r                 unbiased, high variance, can be negative per token
    k2 = ½ (log r)²             biased, low variance, ≥ 0
    k3 = (r − 1) − log r        unbiased, low variance, ≥ 0
All take log-probabilities of the sampled tokens, shapes `(batch, seq)`, and return
`(batch, seq)`; masking and averaging are left to `polo.core.losses.aggregate_loss`.
"""

from __future__ import annotations

from typing import Callable

import torch

# exp(20) ≈ 4.9e8 is finite in fp16/bf16/fp32 alike, while an unclamped exp overflows to inf
# (fp32 past ~88, fp16 past ~11) the first time the policy drifts far from the reference on a
# single token, and one inf poisons the whole loss and its gradients.
K3_LOG_RATIO_LIMIT = 20.0


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Return the k1 estimate `(batch, seq)`: log π(y) − log π_ref(y)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Return the k2 estimate `(batch, seq)`: ½ (log π(y) − log π_ref(y))²."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Return the k3 estimate `(batch, seq)`: exp(d) − d − 1 with d = log π_ref(y) − log π(y).

    Always ≥ 0 (since eˣ ≥ 1 + x) and exactly 0 where the two log-probs agree. d is clamped
    to ±K3_LOG_RATIO_LIMIT so the exponential stays finite; beyond the clamp the gradient
    is zero, which only matters on tokens that are already pathological.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_LIMIT, K3_LOG_RATIO_LIMIT)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Return the per-token KL estimate `(batch, seq)` of the named kind ("k1", "k2", "k3")."""
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {sorted(KL_ESTIMATORS)}") from None
    return estimator(logprobs, ref_logprobs)
