"""GRPO for control: a critic-free group baseline over whole episodes.

Each update resets P groups of G env copies, every copy of a group from the *same* seed (so
the same start state), and plays one episode in each. With R_i the return of episode i,

    A_i = (R_i − mean_g(R)) / (std_g(R) + ε)           (polo.core.group_advantages)

is the advantage of every step of episode i (polo.core.expand_to_tokens) — the language-model
recipe with an episode in place of a completion. The policy then takes `train.epochs` passes
of minibatch steps on the clipped surrogate (polo.core.ppo_clip_loss). No value network.
"""

from __future__ import annotations

import torch

from polo.control.base import OnPolicyAlgorithm, register_algorithm
from polo.control.rollout import Batch
from polo.core.advantages import expand_to_tokens, group_advantages


def episode_group_advantages(
    batch: Batch, group_size: int, scale_by_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (per-step advantages `(M,)`, episode returns `(S,)`) for a batch of whole episodes.

    The batch's segments must be whole episodes, groups of `group_size` contiguous.
    """
    episode_returns = (batch.rewards * batch.mask).sum(dim=1)
    advantages = group_advantages(episode_returns, group_size, scale_by_std=scale_by_std)
    return batch.flatten(expand_to_tokens(advantages, batch.mask)), episode_returns


@register_algorithm("grpo", help="Shao et al. 2024, over groups of episodes from one seed")
class GRPO(OnPolicyAlgorithm):
    collects = "episodes"
    uses_critic = False

    def __init__(self, policy, config):
        super().__init__(policy, config)
        self.optimizer = self.make_optimizer(policy.flat_actor, self.train.learning_rate)

    def update(self, batch: Batch, progress: float) -> dict[str, float]:
        learning_rate = self.set_learning_rates([self.optimizer], progress)
        clip_range = self.scheduled(self.algorithm.clip_range, self.algorithm.clip_schedule, progress)
        advantages, episode_returns = episode_group_advantages(
            batch, self.algorithm.group_size, self.algorithm.scale_by_std
        )
        sums = torch.zeros(4)
        steps = 0
        for _ in range(self.train.epochs):
            for index in self.minibatches(batch.num_transitions):
                surrogate = self.clipped_surrogate(
                    batch.observations[index],
                    batch.actions[index],
                    batch.old_logprobs[index],
                    advantages[index],
                    clip_range,
                )
                entropy = self.policy.entropy(surrogate.outputs).mean()
                self.gradient_step(
                    self.optimizer, surrogate.loss - self.algorithm.entropy_coef * entropy, self.policy.flat_actor
                )
                with torch.no_grad():
                    stats = [surrogate.loss, entropy, surrogate.approx_kl, surrogate.clip_fraction]
                    sums += torch.stack(stats).detach()
                steps += 1
        policy_loss, entropy, approx_kl, clip_fraction = (sums / max(steps, 1)).tolist()
        grouped = episode_returns.reshape(-1, self.algorithm.group_size)
        return {
            "loss/policy": policy_loss,
            "entropy": entropy,
            "approx_kl": approx_kl,
            "clip_fraction": clip_fraction,
            "group_return_std": float(grouped.std(dim=1).mean()),
            "zero_spread_groups": float((grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean()),
            "learning_rate": learning_rate,
            "clip_range": clip_range,
        }
