"""REINFORCE: whole episodes, reward-to-go, one policy-gradient step per batch.

    G_t = Σ_{k≥t} γ^{k−t} r_k                       (polo.core.discounted_returns)
    A_t = G_t − b(s_t),  b = V(s) (learned baseline) or 0
    loss = −A_t log π(a_t|s_t)                      (polo.core.vanilla_pg_loss)

With `algorithm.baseline` the critic V(s) is then regressed on G_t for `train.epochs`
passes with its own optimizer; it never feeds the policy's gradient except as b.
"""

from __future__ import annotations

from polo.control.base import OnPolicyAlgorithm, explained_variance, register_algorithm
from polo.control.rollout import Batch
from polo.core.advantages import discounted_returns


@register_algorithm("reinforce", help="Williams 1992")
class Reinforce(OnPolicyAlgorithm):
    collects = "episodes"
    uses_critic = False  # the trainer adds a critic when algorithm.baseline is true

    def __init__(self, policy, config):
        super().__init__(policy, config)
        self.optimizer = self.make_optimizer(policy.flat_actor, self.train.learning_rate)
        self.optimizers = [self.optimizer]
        self.critic_optimizer = None
        if self.algorithm.baseline:
            self.critic_optimizer = self.make_optimizer(
                policy.flat_critic, self.train.value_learning_rate or self.train.learning_rate
            )
            self.optimizers.append(self.critic_optimizer)

    def update(self, batch: Batch, progress: float) -> dict[str, float]:
        learning_rate = self.set_learning_rates(self.optimizers, progress)
        returns = batch.flatten(discounted_returns(batch.rewards, batch.mask, self.algorithm.gamma))
        advantages = returns - batch.values if batch.values is not None else returns
        policy_loss, outputs = self.policy_gradient_loss(batch, advantages)
        grad_norm = self.gradient_step(self.optimizer, policy_loss, self.policy.flat_actor)
        metrics = {
            "loss/policy": float(policy_loss.detach()),
            "entropy": float(self.policy.entropy(outputs.detach()).mean()),
            "grad_norm": float(grad_norm),
            "learning_rate": learning_rate,
        }
        if self.critic_optimizer is not None:
            metrics["loss/value"] = self.fit_critic(self.critic_optimizer, batch, returns)
            metrics["explained_variance"] = explained_variance(batch.values, returns)
        return metrics
