"""A mixture-of-experts router's load and its load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4-6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouterLoad:
    """One batch's routing over L layers of E experts each.

    `assigned` (E,) is f_e: the token slots sent to expert e per token, averaged over layers (it sums to k,
    the experts per token); `probability` (E,) is P_e: the router's mean probability of expert e. Both count
    only the tokens a mask marks real.
    """

    assigned: torch.Tensor
    probability: torch.Tensor
    top_k: int

    def balancing_loss(self) -> torch.Tensor:
        """Return E · Σ_e f_e · P_e, a scalar: k at a perfectly even split, up to E·k when one expert takes all."""
        return self.assigned.shape[0] * torch.sum(self.assigned * self.probability)

    def expert_fractions(self) -> torch.Tensor:
        """Return the fraction of routed token slots each expert took, (E,), summing to 1 (f_e / k)."""
        return self.assigned.detach() / self.top_k


def router_load(router_logits: list[torch.Tensor], top_k: int, token_mask: torch.Tensor | None = None) -> RouterLoad:
    """Return the `RouterLoad` of `router_logits`, one (tokens, E) tensor per layer, each token routed to its `top_k`.

    With p = softmax(logits) per token, over the real tokens (`token_mask` (tokens,), 1 for real, 0 for
    padding; None: all real) of every layer l:

        f_e = Σ_l Σ_t m_t · [e ∈ top_k(p_{l,t})] / (L · Σ_t m_t)
        P_e = Σ_l Σ_t m_t · p_{l,t,e} / (L · Σ_t m_t)

    the terms of the auxiliary loss `RouterLoad.balancing_loss` (transformers' `load_balancing_loss_func`, which
    TRL's `router_aux_loss_coef` weights). Gradients reach the router through P; f is counted without one.
    """
    assigned = probability = None
    real = None
    for logits in router_logits:
        weights = torch.softmax(logits.float(), dim=-1)  # (tokens, E)
        if real is None:
            real = weights.new_ones(weights.shape[0]) if token_mask is None else token_mask.to(weights).reshape(-1)
        chosen = torch.zeros_like(weights).scatter_(1, torch.topk(weights.detach(), top_k, dim=-1).indices, 1.0)
        layer_assigned = (chosen * real[:, None]).sum(0)
        layer_probability = (weights * real[:, None]).sum(0)
        assigned = layer_assigned if assigned is None else assigned + layer_assigned
        probability = layer_probability if probability is None else probability + layer_probability
    count = real.sum().clamp(min=1.0) * len(router_logits)
    return RouterLoad(assigned / count, probability / count, top_k)
