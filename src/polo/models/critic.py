"""The critic of PPO for language models: a scalar value head on a causal-LM trunk.

Two layouts (`algorithm.critic`):

- ``separate``: a copy of the policy's trunk (the decoder without the lm_head) plus a linear
  head, trained by its own optimizer. Costs a second model, its gradients and its Adam state.
- ``head``: a linear head on the policy's own trunk; one forward gives both the token
  log-probs and the values, and the value loss also shapes the shared trunk.

V(s_t) for completion token t is read from the hidden state that predicts token t, i.e. the
same positions the log-probs come from: `[-completion_len - 1, -1)` of `[prompt | completion]`.
"""

from __future__ import annotations

import torch
from torch import nn

from polo.kernels import LogprobSettings, supports_fused_logprobs, token_logprobs
from polo.models.scoring import position_ids_from_mask


def _hidden_size(model) -> int:
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.hidden_size)


def new_value_head(model) -> nn.Linear:
    """Return a zero-initialised (hidden_size → 1) fp32 value head on `model`'s device, so every value starts at 0."""
    head = nn.Linear(_hidden_size(model), 1, device=next(model.parameters()).device)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class ValueModel(nn.Module):
    """V(prefix) for every position: a decoder trunk followed by a scalar linear head."""

    def __init__(self, trunk: nn.Module, head: nn.Linear):
        super().__init__()
        self.trunk = trunk
        self.head = head

    @classmethod
    def from_policy(cls, policy) -> ValueModel:
        """Return a critic whose trunk is an independent copy of `policy`'s decoder (fp32, trainable)."""
        import copy

        trunk = copy.deepcopy(policy.get_decoder()).float()
        for parameter in trunk.parameters():
            parameter.requires_grad_(True)
        return cls(trunk, new_value_head(policy))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Return values (batch, seq) for every prefix of `input_ids`."""
        hidden = self.trunk(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


def completion_values(critic: ValueModel, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Return V(s_t) for every completion token under a separate critic, (batch, completion_len)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    completion_len = completion_ids.shape[1]
    return critic(input_ids, attention_mask)[:, -completion_len - 1 : -1]


def logprobs_and_values(
    model,
    value_head: nn.Linear,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    scoring: LogprobSettings,
    *,
    detach_trunk_for_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Return (log-probs, entropy or None, values), each (batch, completion_len), from one trunk forward.

    For the ``head`` critic: the policy's hidden states feed both its lm_head (through the
    chunked log-prob path, as `scoring` says: temperature, entropy) and the value head.
    `detach_trunk_for_values` stops the value loss from reaching the trunk (used while only the
    critic warms up).
    """
    if not supports_fused_logprobs(model):
        raise ValueError(
            f"algorithm.critic=head needs a plain decoder model whose logits are lm_head(hidden); "
            f"{type(model).__name__} is not one. Use algorithm.critic=separate."
        )
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    completion_len = completion_ids.shape[1]
    hidden = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state[:, -completion_len - 1 : -1]
    logprobs, entropy = token_logprobs(hidden, model.get_output_embeddings().weight, completion_ids, scoring)
    value_input = hidden.detach() if detach_trunk_for_values else hidden
    values = value_head(value_input.to(value_head.weight.dtype)).squeeze(-1).float()
    return logprobs, entropy, values
