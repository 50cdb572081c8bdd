"""Registries: the algorithms' parts by name, so a preset is data and the loop never branches on it.

Four kinds of part are registered, each a pure function:

    ADVANTAGE_ESTIMATORS  (AdvantageInputs, settings) -> (advantages (batch, seq), returns | None)
    POLICY_LOSSES         (PolicyLossInputs, settings) -> (per_token (batch, seq), stats)
    LOSS_AGGREGATIONS     (per_token, mask, LossNormalisers) -> scalar
    KL_ESTIMATORS         (logprobs, ref_logprobs) -> (batch, seq)

`settings` is the recipe's `algorithm` section (`polo.config.AlgorithmConfig`), so a new estimator
or loss reads its knobs from there and the loop that calls it does not change.

A user adds one with a decorator in their own module::

    from polo.core import register_advantage

    @register_advantage("centered")
    def centered(inputs, settings):
        advantages = inputs.rewards - inputs.rewards.mean()
        return advantages[:, None] * inputs.mask, None

and names it in a recipe as ``algorithm.advantage_estimator: my_module:centered`` (polo imports
``my_module`` first, which runs the decorator). Built-in parts register themselves where their
equations live (`polo.core.advantages`, `polo.core.losses`, `polo.core.kl`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Registered:
    """One registered function and what the loop must provide for it."""

    name: str
    function: Callable[..., Any]
    needs_critic: bool = False  # the estimator reads critic values (PPO's GAE): the loop builds a critic
    token_level: bool = False  # the estimator takes per-token rewards, so the KL can be folded into them


class Registry:
    """A name -> function table of one kind of part; unknown names get an error listing the valid ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Registered] = {}

    def register(self, name: str, **flags: bool) -> Callable[[Callable], Callable]:
        """Return a decorator that registers its function under `name` (re-registering replaces it)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a {self.kind} needs a non-empty name without ':', got {name!r}")

        def decorate(function: Callable) -> Callable:
            self._entries[name] = Registered(name, function, **flags)
            return function

        return decorate

    def entry(self, name: str) -> Registered:
        """Return the registration of `name` (or of "module:name"), or raise ValueError naming the registered ones.

        A "module:name" reference is looked up by its name alone: importing the module, which
        registers it, is the configuration's job (`polo.config.plugins`).
        """
        name = name.rpartition(":")[2]
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {sorted(self._entries)}") from None

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self.entry(name).function

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.rpartition(":")[2] in self._entries

    def __iter__(self):
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """Return the registered names in the order they were registered (built-ins first)."""
        return list(self._entries)


ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGREGATIONS = Registry("loss aggregation")
KL_ESTIMATORS = Registry("KL estimator")


def register_advantage(
    name: str, *, needs_critic: bool = False, token_level: bool = False
) -> Callable[[Callable], Callable]:
    """Register an advantage estimator `(AdvantageInputs, settings) -> (advantages, returns | None)`."""
    return ADVANTAGE_ESTIMATORS.register(name, needs_critic=needs_critic, token_level=token_level)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Register a policy loss `(PolicyLossInputs, settings) -> (per_token (batch, seq), stats)`.

    `per_token` is 0 at padding. `stats` holds detached float sums the loop adds up over
    micro-batches and ranks; it reports `clip_low_count` and `clip_high_count` (tokens clipped
    below and above) as `clip_fraction/low` and `/high` when the loss gives them.
    """
    return POLICY_LOSSES.register(name)


def register_aggregation(name: str) -> Callable[[Callable], Callable]:
    """Register a loss aggregation `(per_token, mask, LossNormalisers) -> scalar`."""
    return LOSS_AGGREGATIONS.register(name)


def register_kl(name: str) -> Callable[[Callable], Callable]:
    """Register a per-token KL estimator `(logprobs, ref_logprobs) -> (batch, seq)`."""
    return KL_ESTIMATORS.register(name)


@dataclass
class AdvantageInputs:
    """What the loop hands every advantage estimator for one batch of whole groups.

    rewards (batch,) total reward per completion; mask (batch, seq) 1 on completion tokens;
    groups of `group_size` rows are contiguous. `kl` (batch, seq) is the per-token KL to the
    reference when `algorithm.kl_in_reward` folds it into the rewards (else None); `values`
    (batch, seq) are the critic's values before the update (None without a critic). `scored`
    (batch,) bool is False for a completion no reward applied to (every TRL-form reward returned
    None), None when every completion was scored; `grpo` leaves those out of its group statistics.
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    group_size: int
    kl: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scored: torch.Tensor | None = None


@dataclass
class PolicyLossInputs:
    """What the loop hands every policy loss for one micro-batch.

    logprobs (batch, seq) under the policy being trained, with gradient; old_logprobs (batch, seq)
    under the policy that sampled, without (the same values as logprobs when the update is
    on-policy); advantages (batch,) per sequence or (batch, seq) per token; mask (batch, seq) 1 on
    the tokens the loss counts.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class LossNormalisers:
    """The counts a loss aggregation divides by, each for the whole optimizer step: every micro-batch of gradient
    accumulation on every rank (`polo.core.distributed.global_count`)."""

    num_sequences: float
    num_tokens: float  # valid tokens
    max_completion_length: int  # sampling.max_new_tokens
    num_micro_batches: float = 1.0
