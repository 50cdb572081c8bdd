"""How the pull toward the reference model changes during a run: the adaptive KL coefficient (Ziegler et al. 2019)
and the reference's soft update toward the policy (TR-DPO, Gorbatovski et al. 2024)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Ziegler et al. 2019 clip the controller's proportional error to ±0.2, so one step moves β by at most 20 % × n / H.
KL_ERROR_CLIP = 0.2


def adaptive_kl_coefficient(beta: float, kl: float, target: float, horizon: float, samples: int) -> float:
    """Return the KL coefficient for the next step of the adaptive KL controller (Ziegler et al. 2019, "Fine-Tuning
    Language Models from Human Preferences"):

        e_t     = clip(KL_t / KL_target − 1, −0.2, 0.2)
        β_{t+1} = β_t · (1 + e_t · n_t / H)

    `kl` (KL_t) is the step's measured KL to the reference, `samples` (n_t) the completions the step trained
    on and `horizon` (H) the controller's horizon in completions; the paper's K_β is n_t / H (its code, and
    verl's `kl_ctrl.type: adaptive`, count n_t per batch the same way). β grows while the policy drifts
    further than the target and shrinks while it stays closer; it stays positive for n_t ≤ H.
    """
    if not (target > 0 and horizon > 0):
        raise ValueError(f"the adaptive KL controller needs target > 0 and horizon > 0, got {target} and {horizon}")
    error = min(max(kl / target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
    return beta * (1.0 + error * samples / horizon)


@torch.no_grad()
def mix_into_reference(reference: Iterable[torch.Tensor], policy: Iterable[torch.Tensor], alpha: float) -> None:
    """Move every `reference` tensor toward its `policy` counterpart in place (TR-DPO's soft update, Gorbatovski et
    al. 2024, "Learn Your Reference Model for Real Good Alignment"):

        θ_ref ← α · θ_policy + (1 − α) · θ_ref

    Tensors pair up in order and have equal shapes; each policy tensor is cast to its reference's dtype and
    device first. α = 1 copies the policy (the paper's hard update).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"the reference mix-up alpha must be in [0, 1], got {alpha}")
    for target, source in zip(reference, policy, strict=True):
        target.mul_(1.0 - alpha).add_(source.to(device=target.device, dtype=target.dtype), alpha=alpha)
