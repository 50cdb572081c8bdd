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
    else:
        # NCCL only reduces tensors that live on the GPU; gloo takes CPU tensors.
        on_gpu = _distributed() and dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        count = torch.tensor(float(value), dtype=torch.float64, device=device)
    return float(all_reduce_sum(count).item())
