"""The one place where batch-spanning normalisers cross process boundaries.

Every count or sum that spans the whole batch (token counts, sequence counts, whitening
statistics) goes through `all_reduce_sum`, so a loop written for one process stays correct
when `torchrun` starts several.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Return the sum of `value` over all ranks (or `value` itself in a single process).

    Under `torch.distributed` the reduction runs on a detached copy, because `all_reduce`
    works in place and is not differentiable: it is meant for normalisers, not for losses.
    Without a process group the very same tensor comes back, with no copy.
    """
    if not _distributed():
        return value
    summed = value.detach().clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed


def global_count(value: float | int | torch.Tensor) -> float:
    """Return the sum of a scalar count over all ranks, as a Python float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"global_count expects a scalar, got a tensor of shape {tuple(value.shape)}")
        count = value.detach().to(torch.float64).reshape(())
    elif not _distributed():
        return float(value)  # nothing to reduce: no tensor at all
    else:
        # A host number: polo's process groups reduce tensors on the default (host) device with
        # gloo, also on GPUs (`cpu:gloo,cuda:nccl`, polo.runtime.parallel), so core never names a device.
        count = torch.tensor(float(value), dtype=torch.float64)
    return float(all_reduce_sum(count).item())
