"""(prompt, response) pairs as token ids and padded batches, and a reward model's score of each.

The layout is the rollouts' (`polo.generation.rollouts`): prompts left-padded, responses
right-padded, `[prompt | response]`. Shared by SFT, DPO, reward-model training and scoring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from polo.models.family import encode_prompts
from polo.models.scoring import position_ids_from_mask
from polo.runtime.device import CPU


@dataclass(frozen=True)
class Encoded:
    """One (prompt, response) as token ids; the response ends with EOS unless it was cut at max_length."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


def encode(tokenizer: Any, prompt_texts: Sequence[str], responses: Sequence[str], max_length: int) -> list[Encoded]:
    """Return each (prompt text, response) as token ids: prompt, then response + EOS, at most `max_length` in all.

    Prompt and response are tokenized separately, the way the policy meets them (prompt tokens,
    then generated ones), so no token spans the boundary. Prompts are already formatted (chat
    template) and get only the tokenizer's BOS, once, when it adds one (`polo.models.family.encode_prompts`,
    as in sampling); responses get no special tokens but the EOS. A response too long for `max_length`
    loses its end (EOS included); a prompt that alone fills `max_length` is an error.
    """
    if len(prompt_texts) != len(responses):
        raise ValueError(f"got {len(prompt_texts)} prompts for {len(responses)} responses")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; responses could not be terminated")
    if not prompt_texts:
        return []
    prompt_ids = encode_prompts(tokenizer, prompt_texts)
    response_ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"]
    encoded = []
    for prompt, response, text in zip(prompt_ids, response_ids, prompt_texts):
        if len(prompt) >= max_length:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens leaves no room for a response under data.max_length={max_length}: "
                f"{text[:80]!r}...; raise data.max_length"
            )
        encoded.append(Encoded(tuple(prompt), tuple((response + [tokenizer.eos_token_id])[: max_length - len(prompt)])))
    return encoded


@dataclass
class TokenBatch:
    """Sequences in the rollout layout: `[prompt | response]`, prompts left-padded, responses right-padded."""

    prompt_ids: torch.Tensor  # (batch, prompt_len)
    prompt_mask: torch.Tensor  # (batch, prompt_len), 1 on real prompt tokens
    response_ids: torch.Tensor  # (batch, response_len)
    response_mask: torch.Tensor  # (batch, response_len), 1 on response tokens (EOS included)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """Return `[prompt | response]` token ids, (batch, prompt_len + response_len)."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """Return 1 on real tokens, 0 on padding, (batch, prompt_len + response_len)."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def labels(self) -> torch.Tensor:
        """Return the training targets in Hugging Face form: `input_ids` with −100 on prompt and padding positions.

        Only response tokens are learned; `model(input_ids, labels=labels).loss` is the token-mean
        negative log-likelihood of the responses.
        """
        prompt_labels = torch.full_like(self.prompt_ids, -100)
        response_labels = self.response_ids.masked_fill(self.response_mask == 0, -100)
        return torch.cat([prompt_labels, response_labels], dim=1)


def collate(encoded: Sequence[Encoded], pad_id: int, device: torch.device = CPU.device) -> TokenBatch:
    """Return the sequences as one `TokenBatch` on `device`, padded with `pad_id` (prompts left, responses right).

    Padded on the host as lists, so each of the four tensors reaches `device` in one copy.
    """
    if not encoded:
        raise ValueError("cannot collate an empty list of sequences")
    prompt_len = max(len(item.prompt_ids) for item in encoded)
    response_len = max(len(item.response_ids) for item in encoded)
    prompt_ids, prompt_mask, response_ids, response_mask = [], [], [], []
    for item in encoded:
        prompt_pad, response_pad = prompt_len - len(item.prompt_ids), response_len - len(item.response_ids)
        prompt_ids.append([pad_id] * prompt_pad + list(item.prompt_ids))
        prompt_mask.append([0] * prompt_pad + [1] * len(item.prompt_ids))
        response_ids.append(list(item.response_ids) + [pad_id] * response_pad)
        response_mask.append([1] * len(item.response_ids) + [0] * response_pad)
    return TokenBatch(
        *(
            torch.tensor(rows, dtype=torch.long, device=device)
            for rows in (prompt_ids, prompt_mask, response_ids, response_mask)
        )
    )


def sequence_rewards(reward_model, batch: TokenBatch) -> torch.Tensor:
    """Return a sequence-classification model's scalar output for each `[prompt | response]`, (batch,).

    The Hugging Face head reads the rightmost token that is not `config.pad_token_id`, so the
    batch must be padded with that id (where the pad token is EOS, as in SmolLM2, the score is read
    at the last response token before EOS, exactly as for the same sequence unpadded). Position ids
    count real tokens only, so left padding changes nothing either.
    """
    attention_mask = batch.attention_mask
    output = reward_model(
        input_ids=batch.input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return output.logits[:, 0].float()
