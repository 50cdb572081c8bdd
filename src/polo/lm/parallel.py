"""Data parallelism for the language-model loop: `torchrun` process groups, rank shards, DDP.

Under `torchrun --nproc_per_node N -m polo train RECIPE` every rank runs the same loop on its own
share of each step's prompts. A group never straddles ranks, so group advantages stay local;
normalisers that span the batch go through `polo.core.all_reduce_sum`; gradients are averaged
by `DistributedDataParallel`. Because polo's losses are normalised by *global* token and
sequence counts, each rank's loss is already its share of the global loss, and the sum over
ranks of the per-rank gradients is the single-process gradient. DDP averages instead of summing,
so the loss is multiplied by the world size before backward (`UpdateModules.loss_scale`).

In one process every function here is a pass-through, so the single-process loop and the
data-parallel loop are the same code.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from polo.core import all_reduce_sum
from polo.lm.critic import logprobs_and_values
from polo.lm.rollout import completion_logprobs


def is_distributed() -> bool:
    """Return True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """Return this process's global rank (0 in a single process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Return the number of ranks (1 in a single process)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def init_from_environment() -> bool:
    """Join the process group `torchrun` describes in the environment; return True if this call created it.

    Nothing happens in a plain single process (no `WORLD_SIZE`, or `WORLD_SIZE=1`) or when the
    caller already initialised a group. The LM loop computes on the CPU, so the backend is gloo.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    dist.init_process_group("gloo")
    return True


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_distributed():
        dist.barrier()


def gather_objects(value: object) -> list:
    """Return `[value of rank 0, value of rank 1, ...]` on every rank (`[value]` in one process)."""
    if not is_distributed():
        return [value]
    gathered: list = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def any_rank(flag: bool) -> bool:
    """Return True on every rank when `flag` is True on at least one rank (a collective decision)."""
    return bool(all_reduce_sum(torch.tensor(float(flag))).item() > 0)


def min_over_ranks(value: int) -> int:
    """Return the smallest `value` over all ranks."""
    if not is_distributed():
        return value
    tensor = torch.tensor(value, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def rank_share(items: list, what: str) -> list:
    """Return this rank's contiguous share of `items` (all of them in one process).

    `len(items)` must divide evenly: a rank's share is whole prompts, hence whole groups.
    """
    ranks = world_size()
    if len(items) % ranks:
        raise ValueError(f"{what}={len(items)} is not divisible by the {ranks} processes; pick a multiple of {ranks}")
    share = len(items) // ranks
    return items[rank() * share : (rank() + 1) * share]


def eval_share(items: list) -> list:
    """Return this rank's strided share of `items` for evaluation (shares may differ in size by one)."""
    return items[rank() :: world_size()]


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Return each value summed over all ranks (one all-reduce for the whole dict)."""
    if not is_distributed() or not values:
        return dict(values)
    keys = sorted(values)
    summed = all_reduce_sum(torch.tensor([float(values[key]) for key in keys], dtype=torch.float64))
    return dict(zip(keys, summed.tolist()))


def combine_metrics(per_rank: list[dict]) -> dict:
    """Return one metrics row from every rank's row: times are the slowest rank's, throughput adds up,
    everything else (already global, or a per-rank mean over equal shares) is averaged."""
    if len(per_rank) == 1:
        return per_rank[0]
    combined = {}
    for key in per_rank[0]:
        values = [row[key] for row in per_rank if isinstance(row.get(key), (int, float))]
        if len(values) != len(per_rank):
            combined[key] = per_rank[0][key]
        elif key.startswith("time/"):
            combined[key] = max(values)
        elif key == "tokens_per_second":
            combined[key] = sum(values)
        else:
            combined[key] = sum(values) / len(values)
    return combined


class TrainingForward(nn.Module):
    """What an update differentiates, as one module so DDP can wrap it: per-token log-probs and
    entropies of a micro-batch, and the values of a value head on the same trunk when there is one."""

    def __init__(self, model: nn.Module, value_head: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.value_head = value_head

    def forward(
        self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature: float = 1.0, detach_trunk_for_values: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Return (log-probs, entropy, values or None), each (batch, completion_len)."""
        if self.value_head is not None:
            return logprobs_and_values(
                self.model, self.value_head, prompt_ids, prompt_mask, completion_ids, completion_mask,
                temperature=temperature, with_entropy=True, detach_trunk_for_values=detach_trunk_for_values,
            )
        logprobs, entropy = completion_logprobs(
            self.model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=temperature, with_entropy=True
        )
        return logprobs, entropy, None


@dataclass
class UpdateModules:
    """The modules an update runs forward and backward through (DDP-wrapped under torchrun)."""

    policy: nn.Module  # TrainingForward, or DDP around it
    critic: nn.Module | None = None  # the separate ValueModel, or DDP around it
    loss_scale: float = 1.0  # world size under DDP: its gradient average then equals the global sum

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Accumulate gradients locally unless `sync` (the last micro-batch of a minibatch all-reduces)."""
        with contextlib.ExitStack() as stack:
            if not sync:
                for module in (self.policy, self.critic):
                    if isinstance(module, nn.parallel.DistributedDataParallel):
                        stack.enter_context(module.no_sync())
            yield


def build_update_modules(model: nn.Module, value_head: nn.Module | None = None, value_model: nn.Module | None = None, *, find_unused_parameters: bool = False) -> UpdateModules:
    """Return the update's modules: plain in one process, wrapped in DDP inside a process group.

    DDP broadcasts rank 0's parameters at construction, so every rank starts from the same
    weights even if they were loaded separately. `find_unused_parameters` is needed only when
    some steps leave part of the model without a gradient (a value head's warm-up).
    """
    policy: nn.Module = TrainingForward(model, value_head)
    critic = value_model
    if not is_distributed():
        return UpdateModules(policy, critic)

    def wrap(module: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(module, find_unused_parameters=find_unused_parameters, broadcast_buffers=False)

    return UpdateModules(wrap(policy), wrap(critic) if critic is not None else None, float(world_size()))
