"""The actor-critic: an MLP policy head (categorical or diagonal Gaussian) and an MLP critic.

The two networks share nothing, so the critic's regression never disturbs the policy's
features (the usual choice for classic control). A distribution is described by one tensor
of parameters — logits, or Gaussian means with a state-independent log std — and the
`Categorical` / `DiagonalGaussian` helpers turn it into log-probs, entropies, samples and
exact KL divergences (TRPO's constraint).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from polo.control.envs import ActionSpec
from polo.core.losses import entropy_from_logits

ACTIVATIONS = ("tanh", "relu")


class Categorical:
    """A categorical policy over `num_actions` choices; parameters are logits `(batch, num_actions)`."""

    @staticmethod
    def sample(logits: torch.Tensor) -> torch.Tensor:
        """Return one action per row `(batch,)` by the Gumbel-max trick: argmax(z − log E), E ~ Exp(1)."""
        return (logits - torch.empty_like(logits).exponential_().log_()).argmax(dim=-1)

    @staticmethod
    def log_prob(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Return log π(a|s) `(batch,)` for integer actions `(batch,)`."""
        log_probs = torch.log_softmax(logits, dim=-1)
        return log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def entropy(logits: torch.Tensor, log_std: torch.Tensor | None = None) -> torch.Tensor:
        """Return H(π(·|s)) `(batch,)`."""
        return entropy_from_logits(logits)

    @staticmethod
    def kl(old_logits: torch.Tensor, logits: torch.Tensor, old_log_std=None, log_std=None) -> torch.Tensor:
        """Return KL(π_old ‖ π) `(batch,)` = Σ_a p_old(a) (log p_old(a) − log p(a))."""
        old_log_probs = torch.log_softmax(old_logits, dim=-1)
        return (old_log_probs.exp() * (old_log_probs - torch.log_softmax(logits, dim=-1))).sum(dim=-1)


class DiagonalGaussian:
    """A Gaussian policy N(μ(s), diag σ²) with a learned, state-independent log σ `(action_dim,)`."""

    @staticmethod
    def sample(mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        """Return a ~ N(mean, σ²) `(batch, action_dim)` (unclipped; the env wrapper clips)."""
        return mean + log_std.exp() * torch.randn_like(mean)

    @staticmethod
    def log_prob(mean: torch.Tensor, actions: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        """Return log π(a|s) `(batch,)` = Σ_d [−(a_d − μ_d)² / 2σ_d² − log σ_d − ½ log 2π]."""
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(dim=-1)

    @staticmethod
    def entropy(mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        """Return H `(batch,)` = Σ_d (log σ_d + ½ log 2πe)."""
        per_row = (log_std + 0.5 * math.log(2 * math.pi * math.e)).sum()
        return per_row.expand(mean.shape[0])

    @staticmethod
    def kl(
        old_mean: torch.Tensor, mean: torch.Tensor, old_log_std: torch.Tensor, log_std: torch.Tensor
    ) -> torch.Tensor:
        """Return KL(π_old ‖ π) `(batch,)` = Σ_d [log σ_d/σ_old,d + (σ_old,d² + (μ_old,d − μ_d)²) / 2σ_d² − ½]."""
        variance = torch.exp(2 * log_std)
        per_dim = log_std - old_log_std + (torch.exp(2 * old_log_std) + (old_mean - mean).pow(2)) / (2 * variance) - 0.5
        return per_dim.sum(dim=-1)


class MLP(nn.Module):
    """A multilayer perceptron `sizes[0] → ... → sizes[-1]`, `activation` between layers (none after the last).

    The forward pass calls `nn.functional.linear` directly rather than nested modules: for networks
    this small, per-call Python overhead is a large share of the cost of a gradient step.
    """

    def __init__(self, sizes: list[int], activation: str, output_gain: float, orthogonal_init: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(fan_in, fan_out) for fan_in, fan_out in zip(sizes[:-1], sizes[1:]))
        self.activation = {"tanh": torch.tanh, "relu": torch.relu}[activation]
        if orthogonal_init:
            for index, linear in enumerate(self.layers):
                is_last = index == len(self.layers) - 1
                # Orthogonal weights keep activations' scale through depth; a tiny policy-head
                # gain starts the policy near uniform, which keeps early exploration broad.
                nn.init.orthogonal_(linear.weight, gain=output_gain if is_last else math.sqrt(2.0))
                nn.init.zeros_(linear.bias)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Return the network's output `(batch, sizes[-1])` for inputs `(batch, sizes[0])`."""
        hidden = inputs
        last = len(self.layers) - 1
        for index, linear in enumerate(self.layers):
            hidden = nn.functional.linear(hidden, linear.weight, linear.bias)
            if index < last:
                hidden = self.activation(hidden)
        return hidden


def share_one_buffer(params: list[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (values, gradients) `(n,)`: flat buffers that `params` are re-pointed to view into.

    Each parameter's data and `.grad` become views of the two buffers, so backward accumulates
    every gradient straight into one flat tensor, and an optimizer, a gradient-norm clip or a
    TRPO step works on one tensor of n numbers instead of a dozen small ones — the per-tensor
    overhead dominates for networks this small. Gradients must then be zeroed in place
    (`gradients.zero_()`); `zero_grad(set_to_none=True)` would silently break the sharing.
    """
    total = sum(param.numel() for param in params)
    values = torch.empty(total)
    gradients = torch.zeros(total)
    offset = 0
    for param in params:
        size = param.numel()
        values[offset : offset + size].copy_(param.data.reshape(-1))
        param.data = values[offset : offset + size].view_as(param)
        param.grad = gradients[offset : offset + size].view_as(param)
        offset += size
    return values, gradients


def flat_view(values: torch.Tensor, gradients: torch.Tensor, start: int, stop: int) -> nn.Parameter:
    """Return a parameter viewing `values[start:stop]` whose `.grad` views `gradients[start:stop]`."""
    parameter = nn.Parameter(values[start:stop])
    parameter.grad = gradients[start:stop]
    return parameter


class ActorCritic(nn.Module):
    """An MLP policy π(a|s) and, when `critic` is True, an MLP state value V(s).

    All parameters live in one flat buffer (see `share_one_buffer`); `flat_actor`,
    `flat_critic` and `flat_all` are single-tensor views of it for optimizers.
    """

    def __init__(
        self,
        observation_size: int,
        actions: ActionSpec,
        hidden_sizes: list[int],
        activation: str = "tanh",
        orthogonal_init: bool = True,
        log_std_init: float = 0.0,
        critic: bool = True,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.actions = actions
        self.distribution = Categorical if actions.discrete else DiagonalGaussian
        self.actor = MLP([observation_size, *hidden_sizes, actions.size], activation, 0.01, orthogonal_init)
        self.log_std = None if actions.discrete else nn.Parameter(torch.full((actions.size,), float(log_std_init)))
        self.critic = MLP([observation_size, *hidden_sizes, 1], activation, 1.0, orthogonal_init) if critic else None
        actor_size = sum(param.numel() for param in self.actor_parameters())
        values, self.gradients = share_one_buffer(self.actor_parameters() + self.critic_parameters())
        self.flat_all = flat_view(values, self.gradients, 0, values.numel())
        self.flat_actor = flat_view(values, self.gradients, 0, actor_size)
        self.flat_critic = flat_view(values, self.gradients, actor_size, values.numel()) if critic else None

    def actor_parameters(self) -> list[nn.Parameter]:
        """Return the parameters of π (the actor network and, for Gaussians, log σ)."""
        params = list(self.actor.parameters())
        return params + ([self.log_std] if self.log_std is not None else [])

    def critic_parameters(self) -> list[nn.Parameter]:
        return [] if self.critic is None else list(self.critic.parameters())

    def value(self, observations: torch.Tensor) -> torch.Tensor:
        """Return V(s) `(batch,)` for observations `(batch, observation_size)`."""
        if self.critic is None:
            raise RuntimeError("this policy was built without a critic (critic=False)")
        return self.critic(observations).squeeze(-1)

    def log_prob(self, params: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Return log π(a|s) `(batch,)` from distribution parameters `(batch, outputs)`."""
        if self.log_std is None:
            return Categorical.log_prob(params, actions)
        return DiagonalGaussian.log_prob(params, actions, self.log_std)

    def entropy(self, params: torch.Tensor) -> torch.Tensor:
        """Return the policy entropy `(batch,)` from distribution parameters."""
        return self.distribution.entropy(params, self.log_std)

    def kl(self, old_params: torch.Tensor, old_log_std: torch.Tensor | None, params: torch.Tensor) -> torch.Tensor:
        """Return the exact KL(π_old ‖ π) `(batch,)`; `old_log_std` is None for categorical policies."""
        return self.distribution.kl(old_params, params, old_log_std, self.log_std)

    @torch.inference_mode()
    def act(self, observations: np.ndarray) -> np.ndarray:
        """Return sampled actions for a numpy batch of observations `(num_envs, observation_size)`."""
        params = self.actor(torch.from_numpy(observations))
        if self.log_std is None:
            return Categorical.sample(params).numpy()
        return DiagonalGaussian.sample(params, self.log_std).numpy()
