"""PPO: GAE advantages, then several epochs of minibatch steps on the clipped surrogate.

    A_t, R_t  = GAE(γ, λ) with V from the critic                    (polo.core.gae_advantages)
    loss      = PPO-clip(ρ_t, Â_t, ε)                                (polo.core.ppo_clip_loss)
              + c_v · ½ max((V − R)², (clip(V, V_old ± ε_v) − R)²)    (polo.core.value_loss)
              − c_H · H(π)
with Â normalised per minibatch, the gradient norm clipped, and the learning rate and ε
optionally annealed linearly to 0. approx-KL (the k3 estimator of KL(π_old ‖ π)) and the
clip fraction are logged as the usual health checks.
"""

from __future__ import annotations

import torch

from polo.control.base import OnPolicyAlgorithm, all_valid, column, explained_variance, normalize, register_algorithm
from polo.control.rollout import Batch
from polo.core.losses import masked_mean, value_loss


@register_algorithm("ppo", help="Schulman et al. 2017")
class PPO(OnPolicyAlgorithm):
    collects = "steps"
    uses_critic = True

    def __init__(self, policy, config):
        super().__init__(policy, config)
        self.optimizer = self.make_optimizer(policy.flat_all, self.train.learning_rate)
        # Actor and critic share no parameters; clipped as one vector, the critic's (often much
        # larger) gradient would scale down the policy's step as well.
        separate = self.train.clip_grad_norm_per_network
        self.clip_groups = [policy.flat_actor, policy.flat_critic] if separate else None

    def update(self, batch: Batch, progress: float) -> dict[str, float]:
        learning_rate = self.set_learning_rates([self.optimizer], progress)
        clip_range = self.scheduled(self.algorithm.clip_range, self.algorithm.clip_schedule, progress)
        advantages, returns = self.gae_targets(batch, self.algorithm.gae_lambda)
        whole_batch = not self.train.minibatch_size or self.train.minibatch_size >= batch.num_transitions
        normalize_each = self.algorithm.normalize_advantages and not whole_batch
        if self.algorithm.normalize_advantages and whole_batch:
            advantages = normalize(advantages)  # the same for every epoch: do it once
        use_entropy = self.algorithm.entropy_coef != 0.0
        stats_sums: list[torch.Tensor] = []
        for _ in range(self.train.epochs):
            for index in self.minibatches_or_all(batch.num_transitions):
                stats = self._minibatch_step(batch, advantages, returns, index, clip_range, normalize_each, use_entropy)
                stats_sums.append(stats)
                if self.algorithm.target_kl is not None and float(stats[2]) > 1.5 * self.algorithm.target_kl:
                    break
            else:
                continue
            break  # the KL limit ended the epoch loop
        policy_loss, critic_loss, approx_kl, clip_fraction = torch.stack(stats_sums).mean(dim=0).tolist()
        with torch.no_grad():
            entropy = float(self.policy.entropy(self.policy.actor(batch.observations)).mean())
        return {
            "loss/policy": policy_loss,
            "loss/value": critic_loss,
            "entropy": entropy,
            "approx_kl": approx_kl,
            "clip_fraction": clip_fraction,
            "explained_variance": explained_variance(batch.values, returns),
            "learning_rate": learning_rate,
            "clip_range": clip_range,
            "gradient_steps": len(stats_sums),
        }

    def _minibatch_step(
        self, batch, advantages, returns, index, clip_range, normalize_each, use_entropy
    ) -> torch.Tensor:
        """Take one gradient step on a minibatch (None: the whole batch); return its detached stats `(4,)`."""
        pick = (lambda values: values) if index is None else (lambda values: values[index])
        observations, old_logprobs, minibatch_advantages = (
            pick(batch.observations),
            pick(batch.old_logprobs),
            pick(advantages),
        )
        if normalize_each:
            minibatch_advantages = normalize(minibatch_advantages)
        surrogate = self.clipped_surrogate(
            observations, pick(batch.actions), old_logprobs, minibatch_advantages, clip_range
        )
        values = self.policy.value(observations)
        mask = all_valid(values)
        per_step_value = value_loss(
            column(values), column(pick(batch.values)), column(pick(returns)), mask, self.algorithm.clip_range_value
        )
        critic_loss = masked_mean(per_step_value, mask)
        loss = surrogate.loss + self.algorithm.value_coef * critic_loss
        if use_entropy:
            loss = loss - self.algorithm.entropy_coef * self.policy.entropy(surrogate.outputs).mean()
        self.gradient_step(self.optimizer, loss, self.policy.flat_all, self.clip_groups)
        with torch.no_grad():
            return torch.stack([surrogate.loss, critic_loss, surrogate.approx_kl, surrogate.clip_fraction]).detach()
