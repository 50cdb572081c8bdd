"""A2C: one gradient step per short rollout on the n-step TD advantage.

    A_t = Σ_{k=0}^{n−1} γ^k r_{t+k} + γ^n V(s_{t+n}) − V(s_t)     (n-step, cut at episode ends)
    loss = −A_t log π(a_t|s_t) + c_v · ½ (V(s_t) − R_t)² − c_H · H(π)

The n-step advantage is GAE with λ = 1 inside each segment of the rollout, bootstrapped with
V of the state after it (polo.core.gae_advantages), so n is `train.rollout_steps` at most.
"""

from __future__ import annotations

from polo.control.base import OnPolicyAlgorithm, all_valid, column, explained_variance, register_algorithm
from polo.control.rollout import Batch
from polo.core.losses import masked_mean, value_loss


@register_algorithm("a2c", help="Mnih et al. 2016")
class A2C(OnPolicyAlgorithm):
    collects = "steps"
    uses_critic = True

    def __init__(self, policy, config):
        super().__init__(policy, config)
        self.optimizer = self.make_optimizer(policy.flat_all, self.train.learning_rate)

    def update(self, batch: Batch, progress: float) -> dict[str, float]:
        learning_rate = self.set_learning_rates([self.optimizer], progress)
        advantages, returns = self.gae_targets(batch, 1.0)  # λ = 1: the n-step advantage
        policy_loss, outputs = self.policy_gradient_loss(batch, advantages)
        values = self.policy.value(batch.observations)
        mask = all_valid(values)
        critic_loss = masked_mean(value_loss(column(values), column(batch.values), column(returns), mask, None), mask)
        entropy = self.policy.entropy(outputs).mean()
        loss = policy_loss + self.algorithm.value_coef * critic_loss - self.algorithm.entropy_coef * entropy
        grad_norm = self.gradient_step(self.optimizer, loss, self.policy.flat_all)
        return {
            "loss/policy": float(policy_loss.detach()),
            "loss/value": float(critic_loss.detach()),
            "entropy": float(entropy.detach()),
            "grad_norm": float(grad_norm),
            "explained_variance": explained_variance(batch.values, returns),
            "learning_rate": learning_rate,
        }
