"""A step's batch as whole groups: which prompts a step draws, and cutting, joining and trimming rollouts.

Groups of `group_size` rows share a prompt and stay contiguous everywhere; nothing here splits one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from polo.generation.rollouts import Rollouts
from polo.runtime import parallel


def batch_rows(rows: list[dict], step: int, prompts_per_step: int, seed: int, stream: int = 0) -> list[dict]:
    """Return the prompts for `step`: consecutive slices of a per-epoch shuffle, a pure function of step.

    Because the data position is derived from the step number, resuming needs no sampler state.
    `stream` > 0 gives independent extra draws for the same step (DAPO's extra sampling rounds).
    """
    picked = []
    start = step * prompts_per_step
    for position in range(start, start + prompts_per_step):
        epoch, index = divmod(position, len(rows))
        order = np.random.default_rng([seed, epoch] if stream == 0 else [seed, epoch, stream]).permutation(len(rows))
        picked.append(rows[int(order[index])])
    return picked


def trim_padding(rollouts: Rollouts) -> Rollouts:
    """Return the rollouts without columns that are padding in every row (less compute, same maths)."""
    prompt_keep = rollouts.prompt_mask.any(0).nonzero()
    prompt_start = int(prompt_keep[0]) if len(prompt_keep) else rollouts.prompt_mask.shape[1]
    completion_len = int(rollouts.completion_lengths.max()) if len(rollouts) else 0
    return Rollouts(
        prompt_ids=rollouts.prompt_ids[:, prompt_start:],
        prompt_mask=rollouts.prompt_mask[:, prompt_start:],
        completion_ids=rollouts.completion_ids[:, :completion_len],
        completion_mask=rollouts.completion_mask[:, :completion_len],
        truncated=rollouts.truncated,
        texts=rollouts.texts,
        group_size=rollouts.group_size,
        loss_mask=None if rollouts.loss_mask is None else rollouts.loss_mask[:, :completion_len],
        episodes=rollouts.episodes,
        sampling_logprobs=None
        if rollouts.sampling_logprobs is None
        else rollouts.sampling_logprobs[:, :completion_len],
    )


def on_device(rollouts: Rollouts, device: torch.device) -> Rollouts:
    """Return the rollouts with every tensor on `device` (the same object when they are there already)."""
    tensors = (
        rollouts.prompt_ids,
        rollouts.prompt_mask,
        rollouts.completion_ids,
        rollouts.completion_mask,
        rollouts.truncated,
    )
    optional = (rollouts.loss_mask, rollouts.sampling_logprobs)
    if all(tensor.device == device for tensor in tensors + tuple(t for t in optional if t is not None)):
        return rollouts
    moved = [tensor.to(device) for tensor in tensors]
    loss_mask, sampling_logprobs = (None if tensor is None else tensor.to(device) for tensor in optional)
    return Rollouts(
        *moved,
        texts=rollouts.texts,
        group_size=rollouts.group_size,
        loss_mask=loss_mask,
        episodes=rollouts.episodes,
        sampling_logprobs=sampling_logprobs,
    )


def micro_batches(rows: torch.Tensor, size: int, group_size: int = 1) -> list[torch.Tensor]:
    """Return `rows` (1-D indices) cut into consecutive chunks of at most `size`.

    With `group_size` > 1 and `size` >= group_size, `size` is rounded down to whole groups, so a
    chunk that starts at a group boundary holds whole groups (their prompt then runs once, see
    polo.kernels.cpu.shared_prompt).
    """
    if group_size > 1 and size >= group_size:
        size -= size % group_size
    return [rows[start : start + size] for start in range(0, len(rows), size)]


@dataclass
class Batch:
    """The completions one step trains on, with their rewards (whole groups, contiguous)."""

    rollouts: Rollouts
    rewards: torch.Tensor  # (batch,) total reward, shaping included
    prompts: list[str]  # one per group
    columns: dict[str, torch.Tensor] | None = None  # (batch,) per reward function, for the completions table

    def select(self, rows: torch.Tensor) -> Batch:
        """Return the rows `rows` (1-D indices of whole groups, each group's rows contiguous and in order)."""
        group_size = self.rollouts.group_size
        prompts = [self.prompts[int(group)] for group in rows[::group_size] // group_size]
        columns = {name: column[rows] for name, column in self.columns.items()} if self.columns is not None else None
        return Batch(self.rollouts.select(rows), self.rewards[rows], prompts, columns)


def concat_batches(parts: list[Batch]) -> Batch:
    """Return the rows of several batches as one batch, in order (see `concat_rollouts`)."""
    columns = parts[0].columns
    if columns is not None:
        columns = {name: torch.cat([part.columns[name] for part in parts]) for name in columns}
    return Batch(
        concat_rollouts([part.rollouts for part in parts]),
        torch.cat([part.rewards for part in parts]),
        [prompt for part in parts for prompt in part.prompts],
        columns,
    )


@dataclass
class UpdateBatch:
    """What one policy update trains on: whole groups of rollouts and the per-token targets of its losses.

    Every tensor but `advantages` is (batch, completion_len); `advantages` is that too, or (batch,)
    with one advantage per sequence.
    """

    rollouts: Rollouts
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None  # the sampling policy's: several optimizer steps, a critic, kl_in_reward
    reference_logprobs: torch.Tensor | None = None  # the reference's, scored when beta > 0
    old_values: torch.Tensor | None = None  # the critic's values before the update (None without a critic)
    returns: torch.Tensor | None = None  # the critic's regression targets (None without a critic)


def concat_rollouts(parts: list[Rollouts]) -> Rollouts:
    """Return the rows of several rollouts in one batch (prompts re-left-padded, completions re-right-padded)."""
    if len(parts) == 1:
        return parts[0]
    prompt_len = max(part.prompt_ids.shape[1] for part in parts)
    completion_len = max(part.completion_ids.shape[1] for part in parts)

    def left(tensor, width):
        return torch.nn.functional.pad(tensor, (width - tensor.shape[1], 0))

    def right(tensor, width):
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))

    return Rollouts(
        prompt_ids=torch.cat([left(part.prompt_ids, prompt_len) for part in parts]),
        prompt_mask=torch.cat([left(part.prompt_mask, prompt_len) for part in parts]),
        completion_ids=torch.cat([right(part.completion_ids, completion_len) for part in parts]),
        completion_mask=torch.cat([right(part.completion_mask, completion_len) for part in parts]),
        truncated=torch.cat([part.truncated for part in parts]),
        texts=[text for part in parts for text in part.texts],
        group_size=parts[0].group_size,
        loss_mask=None
        if parts[0].loss_mask is None
        else torch.cat([right(part.loss_mask, completion_len) for part in parts]),
        episodes=None if parts[0].episodes is None else [episode for part in parts for episode in part.episodes],
        sampling_logprobs=None
        if parts[0].sampling_logprobs is None
        else torch.cat([right(part.sampling_logprobs, completion_len) for part in parts]),
    )


def align_groups(batch: Batch | None, group_size: int) -> Batch | None:
    """Return the batch cut to the fewest groups any rank holds (None when some rank has none).

    Dynamic sampling can leave ranks with different numbers of informative groups; DDP needs
    every rank to take the same optimizer steps, so each keeps only as many groups as the
    poorest rank. In one process the batch comes back unchanged.
    """
    groups = parallel.min_over_ranks(len(batch.rollouts) // group_size if batch is not None else 0)
    if groups == 0:
        return None
    if groups * group_size == len(batch.rollouts):
        return batch
    return batch.select(torch.arange(groups * group_size, device=batch.rewards.device))
