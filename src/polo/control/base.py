"""What every on-policy algorithm shares: optimizers, schedules, minibatches, gradient steps.

An algorithm is a class, registered with `@register_algorithm(name)`, with two class attributes
and one method:
    collects       "steps" (T steps of every env copy per update) or "episodes" (whole episodes)
    uses_critic    whether the policy gets a value network
    update(batch, progress) -> metrics    one policy (and critic) update on a `Batch`

The loop in `polo.control.trainer` owns everything else — collecting, logging, stopping —
so REINFORCE, A2C, TRPO, PPO and GRPO differ only in `update`, the way Stable-Baselines3's
on-policy algorithms differ only in `train()`.

Flat per-transition tensors `(M,)` go through the `(batch, seq)` losses of `polo.core` as
`(M, 1)`: M one-step sequences, all valid.
"""

from __future__ import annotations

import torch
from torch import nn

from polo.control.config import ControlConfig, register_algorithm
from polo.control.policies import ActorCritic
from polo.control.rollout import Batch
from polo.core.advantages import explained_variance as masked_explained_variance
from polo.core.advantages import whiten
from polo.core.losses import masked_mean, value_loss, vanilla_pg_loss
from polo.core.schedules import lr_multiplier
from polo.runtime.optimizer import build_optimizer

__all__ = ["OnPolicyAlgorithm", "all_valid", "column", "explained_variance", "normalize", "register_algorithm"]


def column(values: torch.Tensor) -> torch.Tensor:
    """Return a flat per-transition tensor `(M,)` as M one-step sequences `(M, 1)`."""
    return values.unsqueeze(-1)


def all_valid(values: torch.Tensor) -> torch.Tensor:
    """Return the mask `(M, 1)` of M one-step sequences, all valid."""
    return torch.ones(values.shape[0], 1, dtype=torch.bool)


def normalize(advantages: torch.Tensor) -> torch.Tensor:
    """Return flat advantages `(M,)` whitened to zero mean and unit variance (`polo.core.whiten`)."""
    return whiten(column(advantages), all_valid(advantages)).squeeze(-1)


def explained_variance(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """Return 1 − Var(target − predicted) / Var(target) of flat transitions `(M,)` (`polo.core.explained_variance`)."""
    return masked_explained_variance(column(predicted), column(target), all_valid(target))


class OnPolicyAlgorithm:
    """Shared machinery for the update rules; subclasses implement `update`."""

    collects: str = "steps"
    uses_critic: bool = True

    def __init__(self, policy: ActorCritic, config: ControlConfig):
        self.policy = policy
        self.config = config
        self.algorithm = config.algorithm
        self.train = config.train

    # --- optimizers and schedules -------------------------------------------------------
    def make_optimizer(self, flat: nn.Parameter, learning_rate: float) -> torch.optim.Optimizer:
        """Return the configured optimizer (`polo.runtime.optimizer`) over one flat parameter view."""
        kind = "rmsprop" if self.train.optimizer == "rmsprop" else "adamw"
        return build_optimizer([flat], self.train, learning_rate=learning_rate, kind=kind)

    def scheduled(self, value: float, schedule: str, progress: float) -> float:
        """Return `value` under a schedule at `progress` ∈ [0, 1] of the run: constant, or linear to 0."""
        return value * max(1.0 - progress, 0.0) if schedule == "linear" else value

    def set_learning_rates(self, optimizers: list[torch.optim.Optimizer], progress: float) -> float:
        """Apply the learning-rate schedule at `progress` of `train.total_steps`; return the first optimizer's rate.

        The schedule is polo's one warm-up-then-decay (`polo.core.lr_multiplier`) over environment steps.
        """
        total = self.train.total_steps
        multiplier = lr_multiplier(self.train.warmup_steps, total, self.train.lr_schedule)(round(progress * total))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * multiplier
        return optimizers[0].param_groups[0]["lr"]

    # --- minibatches and gradient steps -------------------------------------------------
    def minibatches(self, num_transitions: int):
        """Yield index tensors that cover a random permutation of the batch in minibatches."""
        size = self.train.minibatch_size or num_transitions
        order = torch.randperm(num_transitions)
        for start in range(0, num_transitions, size):
            yield order[start : start + size]

    def minibatches_or_all(self, num_transitions: int):
        """Yield minibatch index tensors, or once None when one minibatch is the whole batch."""
        if not self.train.minibatch_size or self.train.minibatch_size >= num_transitions:
            yield None  # a full-batch gradient does not depend on the order: skip the shuffle
        else:
            yield from self.minibatches(num_transitions)

    def gradient_step(
        self,
        optimizer: torch.optim.Optimizer,
        loss: torch.Tensor,
        flat: nn.Parameter,
        clip_groups: list[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """Backpropagate `loss`, clip gradient norms (if configured), step; return the pre-clip norm of `flat`.

        `flat` is the optimizer's flat parameter view (`ActorCritic.flat_*`): its gradient is
        zeroed in place, since the network's parameters accumulate into that very buffer.
        `clip_groups` (views inside `flat`) are clipped each to `train.max_grad_norm` on their
        own; by default `flat` is clipped as a whole.
        """
        flat.grad.zero_()
        loss.backward()
        norm = torch.linalg.vector_norm(flat.grad)
        if self.train.max_grad_norm is not None:
            for group in clip_groups or [flat]:
                group_norm = norm if group is flat else torch.linalg.vector_norm(group.grad)
                group.grad.mul_(torch.clamp(self.train.max_grad_norm / (group_norm + 1e-6), max=1.0))
        optimizer.step()
        return norm

    def fit_critic(self, optimizer: torch.optim.Optimizer, batch: Batch, returns: torch.Tensor) -> float:
        """Regress V(s) on `returns` `(M,)` for `train.epochs` passes of minibatches; return the last mean loss."""
        losses = []
        for _ in range(self.train.epochs):
            for index in self.minibatches(batch.num_transitions):
                values = self.policy.value(batch.observations[index])
                per_step = value_loss(
                    column(values), column(values.detach()), column(returns[index]), all_valid(values), None
                )
                loss = masked_mean(per_step, all_valid(values))
                self.gradient_step(optimizer, loss, self.policy.flat_critic)
                losses.append(loss.detach())
        return float(torch.stack(losses[-max(1, len(losses) // self.train.epochs) :]).mean())

    def policy_gradient_loss(self, batch: Batch, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (the mean REINFORCE loss −A·log π over the batch, the actor's outputs), advantages normalised if
        configured."""
        if self.algorithm.normalize_advantages:
            advantages = normalize(advantages)
        outputs = self.policy.actor(batch.observations)
        logprobs = self.policy.log_prob(outputs, batch.actions)
        mask = all_valid(logprobs)
        return masked_mean(vanilla_pg_loss(column(logprobs), column(advantages), mask), mask), outputs

    def update(self, batch: Batch, progress: float) -> dict[str, float]:
        raise NotImplementedError
