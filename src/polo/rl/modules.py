"""The modules an RL update runs forward and backward through, wrapped for data parallelism.

In one process they are plain modules; inside a process group the policy (and a separate critic)
are wrapped in DistributedDataParallel, and FSDP-sharded policies reduce their own gradients.
See `polo.runtime.parallel` for why the loss is scaled by the world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from polo.kernels import LogprobSettings
from polo.models.critic import logprobs_and_values
from polo.models.scoring import completion_logprobs
from polo.runtime.parallel import data_parallel, is_distributed, is_sharded, world_size


class TrainingForward(nn.Module):
    """What an update differentiates, as one module so DDP can wrap it: per-token log-probs and
    entropies of a micro-batch, and the values of a value head on the same trunk when there is one."""

    def __init__(self, model: nn.Module, value_head: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.value_head = value_head

    def forward(
        self,
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        *,
        temperature: float = 1.0,
        detach_trunk_for_values: bool = False,
        group_size: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Return (log-probs, entropy, values or None), each (batch, completion_len); `group_size` as in
        `completion_logprobs`."""
        if self.value_head is not None:
            return logprobs_and_values(
                self.model,
                self.value_head,
                prompt_ids,
                prompt_mask,
                completion_ids,
                completion_mask,
                LogprobSettings(temperature=temperature, with_entropy=True),
                detach_trunk_for_values=detach_trunk_for_values,
            )
        logprobs, entropy = completion_logprobs(
            self.model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            temperature=temperature,
            with_entropy=True,
            group_size=group_size,
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
        """Accumulate gradients locally unless `sync` (the last micro-batch of a minibatch reduces them)."""
        with contextlib.ExitStack() as stack:
            if not sync:
                for module in (self.policy, self.critic):
                    if isinstance(module, nn.parallel.DistributedDataParallel):
                        stack.enter_context(module.no_sync())
                    elif isinstance(module, TrainingForward) and is_sharded(module.model):
                        module.model.set_requires_gradient_sync(False)
                        stack.callback(module.model.set_requires_gradient_sync, True)
            yield


def build_update_modules(
    model: nn.Module,
    value_head: nn.Module | None = None,
    value_model: nn.Module | None = None,
    *,
    find_unused_parameters: bool = False,
) -> UpdateModules:
    """Return the update's modules: plain in one process, wrapped in DDP inside a process group.

    DDP broadcasts rank 0's parameters at construction, so every rank starts from the same
    weights even if they were loaded separately. `find_unused_parameters` is needed only when
    some steps leave part of the model without a gradient (a value head's warm-up).
    """
    policy: nn.Module = TrainingForward(model, value_head)
    critic = value_model
    if not is_distributed():
        return UpdateModules(policy, critic)
    if is_sharded(model):  # FSDP reduce-scatters (averages) the gradients itself
        if value_head is not None or value_model is not None:
            raise ValueError(
                "train.data_parallel=fsdp does not support a critic yet (PPO); use train.data_parallel=ddp"
            )
        return UpdateModules(policy, None, float(world_size()))

    def wrap(module: nn.Module) -> nn.Module:
        return data_parallel(module, find_unused_parameters)  # DDP on the module's device (one GPU per rank)

    return UpdateModules(wrap(policy), wrap(critic) if critic is not None else None, float(world_size()))
