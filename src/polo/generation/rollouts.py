"""What sampling returns (`Rollouts`) and what a sampler is (`Sampler`).

Layout used everywhere: prompts are left-padded to a common length `prompt_len`, completions are
right-padded to `completion_len`, so a batch is the concatenation `[prompt | completion]` of
shape `(batch, prompt_len + completion_len)` and the completion tokens are always its last
`completion_len` positions. Groups of `group_size` rows share a prompt and are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from polo.runtime.device import CPU, Compute


@dataclass
class Rollouts:
    """A batch of sampled completions; groups of `group_size` rows share a prompt and are contiguous."""

    prompt_ids: torch.Tensor  # (batch, prompt_len), left-padded
    prompt_mask: torch.Tensor  # (batch, prompt_len), 1 on real prompt tokens
    completion_ids: torch.Tensor  # (batch, completion_len), right-padded
    completion_mask: torch.Tensor  # (batch, completion_len), 1 on generated tokens (EOS included)
    truncated: torch.Tensor  # (batch,) bool: stopped by max_new_tokens, not by EOS
    texts: list[str]  # decoded completions, special tokens removed
    group_size: int

    @property
    def completion_lengths(self) -> torch.Tensor:
        """Return the number of generated tokens per row, shape (batch,)."""
        return self.completion_mask.sum(-1)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> Rollouts:
        """Return the rows `rows` (whole groups are the caller's business)."""
        if isinstance(rows, slice):
            texts = self.texts[rows]
        else:
            texts = [self.texts[i] for i in rows.tolist()]
        return Rollouts(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            truncated=self.truncated[rows],
            texts=texts,
            group_size=self.group_size,
        )


class Sampler(Protocol):
    """What samples completions: `group_size` per prompt, groups contiguous, as `Rollouts` on `compute.device`.

    Two implementations, one prefill per prompt shared by its samples in both: the CPU KV-cache
    sampler (`polo.generation.cpu_sampler.rollout`, finished rows dropped) and the static-cache
    sampler (`polo.generation.static_sampler.rollout`, fixed shapes, captured on CUDA).
    `polo.generation.grouped.pick_sampler` chooses one for a `Compute`.
    """

    def __call__(
        self,
        model,
        tokenizer,
        prompts: list[str],
        group_size: int,
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        compute: Compute = CPU,
    ) -> Rollouts: ...
