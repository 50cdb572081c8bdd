"""PPO's critic behind one small interface: the loop asks it for old values, a value loss and a step.

An advantage estimator registered with ``needs_critic=True`` (GAE) makes `build_critic` return a
`Critic`; every other run has ``critic = None`` and none of this code runs. Two layouts
(`algorithm.critic`, see `polo.models.critic`):

- ``separate``: its own trunk and head with their own AdamW; its forward and backward run after
  the policy's, so the two graphs never coexist (half the peak activations).
- ``head``: a value head on the policy's trunk, in the policy's optimizer; the policy's forward
  returns the values too, and one backward trains both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polo import core
from polo.config import Config
from polo.generation.rollouts import Rollouts
from polo.kernels import LogprobSettings
from polo.models.critic import ValueModel, completion_values, logprobs_and_values, new_value_head
from polo.models.loading import enable_activation_checkpointing, recompute_above
from polo.rl.batching import UpdateBatch, micro_batches, trim_padding
from polo.runtime.device import Compute
from polo.runtime.optimizer import build_optimizer, build_schedule


@dataclass
class Critic:
    """The value function of PPO and its optimizer: a separate `ValueModel`, or a head on the policy trunk."""

    layout: str  # "separate" | "head"
    module: torch.nn.Module  # ValueModel (separate) or nn.Linear (head)
    optimizer: torch.optim.Optimizer | None  # None for "head": its parameters sit in the policy optimizer
    scheduler: object | None
    warmup_steps: int = 0

    @property
    def value_head(self) -> torch.nn.Module | None:
        """Return the head that rides on the policy's forward (None for a separate critic)."""
        return self.module if self.layout == "head" else None

    @property
    def value_model(self) -> torch.nn.Module | None:
        """Return the separate value model (None for a head on the policy trunk)."""
        return self.module if self.layout == "separate" else None

    def trains_policy(self, step: int) -> bool:
        """Return whether step `step` moves the policy (False while the critic warms up alone)."""
        return step > self.warmup_steps

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def step(self, max_grad_norm: float) -> float:
        """Clip and apply a separate critic's gradients; return its gradient norm (0 for a head)."""
        if self.optimizer is None:
            return 0.0
        norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        return norm

    def state(self) -> dict:
        """Return what a checkpoint needs to restore the critic."""
        state = {"critic": self.module.state_dict()}
        if self.optimizer is not None:
            state["critic_optimizer"] = self.optimizer.state_dict()
            state["critic_scheduler"] = self.scheduler.state_dict()
        return state

    def load(self, state: dict) -> None:
        """Restore the critic from a checkpoint's state (see `state`)."""
        self.module.load_state_dict(state["critic"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["critic_optimizer"])
            self.scheduler.load_state_dict(state["critic_scheduler"])

    @torch.no_grad()
    def score(
        self, model, rollouts: Rollouts, micro_batch_size: int, compute: Compute, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (values, log-probs or None) of every completion token before the update, each (batch, completion_len).

        The ``head`` critic shares the policy's forward, so its log-probs come for free; the
        ``separate`` critic runs its own trunk and returns None for the log-probs.
        """
        device = rollouts.completion_ids.device
        values = torch.zeros(rollouts.completion_ids.shape, dtype=torch.float32, device=device)
        logprobs = (
            torch.zeros(rollouts.completion_ids.shape, dtype=torch.float32, device=device)
            if self.layout == "head"
            else None
        )
        for rows in micro_batches(torch.arange(len(rollouts), device=device), micro_batch_size):
            part = trim_padding(rollouts.select(rows))
            width = part.completion_ids.shape[1]
            inputs = (part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask)
            with compute.autocast():
                if self.layout == "head":
                    part_logprobs, _, part_values = logprobs_and_values(
                        model, self.module, *inputs, LogprobSettings(temperature=temperature)
                    )
                    logprobs[rows, :width] = part_logprobs.float()
                else:
                    part_values = completion_values(self.module, *inputs)
            values[rows, :width] = part_values.float()
        return values, logprobs


def value_loss(
    values: torch.Tensor,
    batch: UpdateBatch,
    micro: torch.Tensor,
    mask: torch.Tensor,
    alg,
    normalisers: core.LossNormalisers,
) -> torch.Tensor:
    """Return the clipped value loss of one micro-batch, token-mean over the whole minibatch.

    The targets are `batch.old_values` and `batch.returns`, each (batch, completion_len); `micro` the rows.
    """
    old_values, returns = batch.old_values, batch.returns
    width = values.shape[1]
    per_token = core.value_loss(values.float(), old_values[micro, :width], returns[micro, :width], mask, alg.value_clip)
    return core.aggregate_loss(per_token, mask, "token_mean", normalisers)


def build_critic(config: Config, model, optimizer, total_steps: int) -> Critic | None:
    """Return the critic the config's advantage estimator needs (None when it needs none).

    A ``head`` joins the policy's `optimizer`; a ``separate`` critic gets its own AdamW
    (`polo.runtime.optimizer`, at `algorithm.critic_learning_rate`) with the policy's schedule
    over `total_steps` optimizer steps.
    """
    alg, train_config = config.algorithm, config.train
    if not core.ADVANTAGE_ESTIMATORS.entry(alg.advantage_estimator).needs_critic:
        return None
    if alg.critic == "head":
        head = new_value_head(model)
        optimizer.add_param_group(
            {"params": list(head.parameters()), "lr": alg.critic_learning_rate, "initial_lr": alg.critic_learning_rate}
        )
        return Critic("head", head, None, None, alg.critic_warmup_steps)
    value_model = ValueModel.from_policy(model)
    value_model.train()
    if train_config.gradient_checkpointing:  # the policy's trunk and threshold: the value model is a copy of it
        enable_activation_checkpointing(value_model.trunk, above_tokens=recompute_above(model))
    critic_optimizer = build_optimizer(value_model.parameters(), train_config, learning_rate=alg.critic_learning_rate)
    critic_scheduler = build_schedule(critic_optimizer, train_config, total_steps)
    return Critic("separate", value_model, critic_optimizer, critic_scheduler, alg.critic_warmup_steps)
