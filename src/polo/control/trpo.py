"""TRPO: a natural-gradient step to the KL radius δ, then a line search that enforces it.

    L(θ) = mean_t [π_θ(a_t|s_t) / π_old(a_t|s_t) · Â_t]         surrogate, Â from GAE
    g = ∇L,  x = F⁻¹g by conjugate gradient on Fisher-vector products
    s = sqrt(2δ / xᵀFx) · x,  then s ← ½ s until KL(π_old ‖ π_θ+s) ≤ δ and L improves

(the maths is in `polo.core.trpo`). The critic is fitted afterwards by Adam on the GAE
value targets, `train.epochs` passes of minibatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polo.control.base import OnPolicyAlgorithm, explained_variance, normalize, register_algorithm
from polo.control.policies import ActorCritic
from polo.control.rollout import Batch
from polo.core.trpo import (
    backtracking_line_search,
    conjugate_gradient,
    fisher_vector_product,
    flat_grad,
    trust_region_step,
)


@dataclass(frozen=True)
class TrustRegion:
    """TRPO's step: the KL radius δ, and how the natural-gradient direction and the step length are found."""

    max_kl: float  # δ
    cg_iterations: int = 10  # conjugate-gradient iterations for x = F⁻¹g
    cg_damping: float = 0.1  # F + damping·I keeps the solve well conditioned
    line_search_steps: int = 10  # at most this many backtracks of the line search
    line_search_shrink: float = 0.5  # each backtrack multiplies the step by this


def trpo_step(
    policy: ActorCritic,
    observations: torch.Tensor,
    actions: torch.Tensor,
    advantages: torch.Tensor,
    region: TrustRegion,
) -> dict[str, float]:
    """Update the policy's actor in place by one TRPO step within `region`; return its diagnostics.

    Shapes: observations (M, observation_size), actions (M,) or (M, action_dim), advantages (M,).
    """
    max_kl, cg_damping = region.max_kl, region.cg_damping
    params = policy.actor_parameters()
    with torch.no_grad():
        old_params = policy.actor(observations)
        old_logprobs = policy.log_prob(old_params, actions)
        old_log_std = None if policy.log_std is None else policy.log_std.detach().clone()

    def surrogate() -> torch.Tensor:
        ratio = torch.exp(policy.log_prob(policy.actor(observations), actions) - old_logprobs)
        return (ratio * advantages).mean()

    def mean_kl() -> torch.Tensor:
        return policy.kl(old_params, old_log_std, policy.actor(observations)).mean()

    loss = surrogate()
    gradient = flat_grad(loss, params)
    kl_grad = flat_grad(mean_kl(), params, create_graph=True)

    def fisher(vector: torch.Tensor) -> torch.Tensor:
        return fisher_vector_product(kl_grad, params, vector, cg_damping)

    direction = conjugate_gradient(fisher, gradient, region.cg_iterations)
    full_step = trust_region_step(direction, fisher(direction), max_kl)
    expected_improvement = float(gradient @ full_step)
    start = policy.flat_actor.detach().clone()
    old_loss = float(loss.detach())

    def evaluate(step: torch.Tensor) -> tuple[float, float]:
        with torch.no_grad():
            policy.flat_actor.copy_(start + step)
            improvement, kl = float(surrogate()) - old_loss, float(mean_kl())
            policy.flat_actor.copy_(start)
        return improvement, kl

    step, backtracks = backtracking_line_search(
        evaluate,
        full_step,
        expected_improvement,
        max_kl,
        shrink=region.line_search_shrink,
        max_backtracks=region.line_search_steps,
    )
    with torch.no_grad():
        policy.flat_actor.copy_(start + step)
        kl = float(mean_kl())
        improvement = float(surrogate()) - old_loss
    return {
        "loss/policy": -old_loss,
        "kl": kl,
        "surrogate_improvement": improvement,
        "expected_improvement": expected_improvement,
        "line_search_backtracks": float(backtracks),
        "step_accepted": float(backtracks >= 0),
    }


@register_algorithm("trpo", help="Schulman et al. 2015")
class TRPO(OnPolicyAlgorithm):
    collects = "steps"
    uses_critic = True

    def __init__(self, policy, config):
        super().__init__(policy, config)
        self.critic_optimizer = self.make_optimizer(
            policy.flat_critic, self.train.value_learning_rate or self.train.learning_rate
        )

    def update(self, batch: Batch, progress: float) -> dict[str, float]:
        learning_rate = self.set_learning_rates([self.critic_optimizer], progress)
        advantages, returns = self.gae_targets(batch, self.algorithm.gae_lambda)
        if self.algorithm.normalize_advantages:
            advantages = normalize(advantages)
        alg = self.algorithm
        region = TrustRegion(
            max_kl=alg.max_kl,
            cg_iterations=alg.cg_iterations,
            cg_damping=alg.cg_damping,
            line_search_steps=alg.line_search_steps,
            line_search_shrink=alg.line_search_shrink,
        )
        metrics = trpo_step(self.policy, batch.observations, batch.actions, advantages, region)
        with torch.no_grad():
            metrics["entropy"] = float(self.policy.entropy(self.policy.actor(batch.observations)).mean())
        metrics["loss/value"] = self.fit_critic(self.critic_optimizer, batch, returns)
        metrics["explained_variance"] = explained_variance(batch.values, returns)
        metrics["learning_rate"] = learning_rate
        return metrics
