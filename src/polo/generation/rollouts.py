"""What sampling returns (`Rollouts`) and what a sampler is (`Sampler`).

Layout used everywhere: prompts are left-padded to a common length `prompt_len`, completions are
right-padded to `completion_len`, so a batch is the concatenation `[prompt | completion]` of
shape `(batch, prompt_len + completion_len)` and the completion tokens are always its last
`completion_len` positions. Groups of `group_size` rows share a prompt and are contiguous.

A multi-turn episode (`polo.generation.episodes`) keeps the same layout: its first prompt is the
prompt, and everything after it (the model's turns, the tools' observations, the chat template's
tokens between them) is the completion, so `completion_mask` stays contiguous. `loss_mask` then
marks the tokens the model wrote, the only ones the policy loss, the KL and the entropy count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from polo.generation.prompts import tokenize_prompts
from polo.generation.sampling import Decoding
from polo.generation.stopping import Stopping
from polo.runtime.device import CPU, Compute


@dataclass
class EpisodeRecord:
    """What happened in one episode: the model's turns, the observations, the environment's reward, the tool use."""

    turns: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    reward: float | None = None  # the sum of the environment's rewards (None when it gave none)
    done: bool = False  # the environment ended it (not a limit)
    tool_calls: int = 0
    tool_failures: int = 0
    tool_seconds: float = 0.0

    @property
    def answer(self) -> str:
        """Return the model's last turn: the text its final answer is read from."""
        return self.turns[-1] if self.turns else ""

    @property
    def transcript(self) -> str:
        """Return the episode as text: the model's turns with each observation after the turn it answered."""
        parts = []
        for index, turn in enumerate(self.turns):
            parts.append(turn)
            if index < len(self.observations):
                parts.append(f"[observation]\n{self.observations[index]}\n[/observation]")
        return "\n".join(parts)


@dataclass
class Rollouts:
    """A batch of sampled completions; groups of `group_size` rows share a prompt and are contiguous."""

    prompt_ids: torch.Tensor  # (batch, prompt_len), left-padded
    prompt_mask: torch.Tensor  # (batch, prompt_len), 1 on real prompt tokens
    completion_ids: torch.Tensor  # (batch, completion_len), right-padded
    completion_mask: torch.Tensor  # (batch, completion_len), 1 on generated tokens (EOS included)
    truncated: torch.Tensor  # (batch,) bool: stopped by max_new_tokens, not by EOS
    texts: list[str]  # decoded completions, special tokens removed (an episode's: its last turn, what is graded)
    group_size: int
    loss_mask: torch.Tensor | None = None  # (batch, completion_len), 1 on tokens the model wrote; None: completion_mask
    episodes: list[EpisodeRecord] | None = None  # per row, what happened in a multi-turn episode (None: one turn)
    # (batch, completion_len) the sampler's own log-prob of each drawn token, under the sampling temperature; None
    # where the sampler did not record them (Decoding.record_logprobs)
    sampling_logprobs: torch.Tensor | None = None

    @property
    def model_token_mask(self) -> torch.Tensor:
        """Return the mask of the tokens the model wrote, (batch, completion_len): `loss_mask` or `completion_mask`."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def completion_lengths(self) -> torch.Tensor:
        """Return the number of generated tokens per row, shape (batch,)."""
        return self.completion_mask.sum(-1)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> Rollouts:
        """Return the rows `rows` (whole groups are the caller's business)."""
        texts = self.texts[rows] if isinstance(rows, slice) else [self.texts[i] for i in rows.tolist()]
        return Rollouts(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            truncated=self.truncated[rows],
            texts=texts,
            group_size=self.group_size,
            loss_mask=None if self.loss_mask is None else self.loss_mask[rows],
            episodes=None if self.episodes is None else [self.episodes[i] for i in _indices(rows, len(self))],
            sampling_logprobs=None if self.sampling_logprobs is None else self.sampling_logprobs[rows],
        )


def _indices(rows: torch.Tensor | slice, length: int) -> list[int]:
    """Return `rows` (a slice or index tensor) as a list of row indices into `length` rows."""
    return list(range(length))[rows] if isinstance(rows, slice) else rows.tolist()


class Sampler(Protocol):
    """What samples completions: `group_size` per prompt, groups contiguous, as `Rollouts` on `compute.device`.

    Two implementations, one prefill per prompt shared by its samples in both: the CPU KV-cache
    sampler (`polo.generation.cpu_sampler.rollout`, finished rows dropped) and the static-cache
    sampler (`polo.generation.static_sampler.rollout`, fixed shapes, captured on CUDA).
    `polo.generation.grouped.pick_sampler` chooses one for a `Compute`. The multi-turn sampler
    (`polo.generation.episodes.EpisodeSampler`) drives an environment over either; it starts each
    episode from its task row, so callers pass `rows` (the one-turn samplers do not read them).
    """

    def __call__(
        self,
        model,
        tokenizer,
        prompts: list[str],
        group_size: int,
        decoding: Decoding,
        *,
        compute: Compute = CPU,
        rows: Sequence[dict] | None = None,
    ) -> Rollouts: ...


def one_turn_rollouts(
    generate: Callable,
    model,
    tokenizer,
    prompts: list[str],
    group_size: int,
    decoding: Decoding,
    compute: Compute,
    **options,
) -> Rollouts:
    """Return `group_size` completions for each prompt drawn by a one-turn sampler's `generate`, groups contiguous.

    What both one-turn samplers' `rollout` do around their own `generate`: tokenize the prompts
    onto `compute.device`, sample, repeat each prompt for its group, decode the completions.
    `options` go to `generate` as they are (the static sampler's `capture`).
    """
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)
    prompt_ids, prompt_mask = prompt_ids.to(compute.device), prompt_mask.to(compute.device)
    completion_ids, completion_mask, truncated, *recorded = generate(
        model,
        prompt_ids,
        prompt_mask,
        decoding,
        Stopping.of(tokenizer, model),
        compute=compute,
        samples_per_prompt=group_size,
        **options,
    )
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    padded = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(padded, skip_special_tokens=True)
    return Rollouts(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        truncated,
        texts,
        group_size,
        sampling_logprobs=recorded[0] if recorded else None,
    )
