"""Data parallelism for the language-model loop: `torchrun` process groups, rank shards, DDP.

Under `torchrun --nproc_per_node N -m polo train RECIPE` every rank runs the same loop on its own
share of each step's prompts. A group never straddles ranks, so group advantages stay local;
normalisers that span the batch go through `polo.core.all_reduce_sum`; gradients are averaged
by `DistributedDataParallel`. Because polo's losses are normalised by *global* token and
sequence counts, each rank's loss is already its share of the global loss, and the sum over
ranks of the per-rank gradients is the single-process gradient. DDP averages instead of summing,
so the loss is multiplied by the world size before backward (`UpdateModules.loss_scale`).

With `train.data_parallel=fsdp` the policy is sharded instead (`torch.distributed.fsdp.fully_shard`
per decoder layer): each rank keeps 1/N of the parameters, gradients and Adam state. Generation
gathers the whole weights once per rollout (`gathered_weights`), so ranks may decode different
numbers of tokens without waiting on each other; updates run forward and backward shard by shard.

On GPUs each rank takes the GPU of its LOCAL_RANK (`polo.runtime.device.resolve_device`), the
group is `cpu:gloo,cuda:nccl` (tensors on the GPU go through NCCL, polo's host-side flags and
counts through gloo), DDP is given the rank's one device, and FSDP shards onto it. On the CPU
the group is plain gloo.

In one process every function here is a pass-through, so the single-process loop and the
data-parallel loop are the same code.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from polo.core import all_reduce_sum


def is_distributed() -> bool:
    """Return True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """Return this process's global rank (0 in a single process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Return the number of ranks (1 in a single process)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# NCCL reduces only GPU tensors, but polo's flags, counts and object gathers are CPU scalars: on
# GPUs the group routes CPU tensors to gloo and CUDA tensors to NCCL (as verl does).
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def backend_for(device: torch.device) -> str:
    """Return the process-group backend for ranks computing on `device`: gloo on the CPU, gloo + NCCL on CUDA."""
    return GPU_BACKEND if device.type == "cuda" else "gloo"


def init_from_environment(device: torch.device | None = None) -> bool:
    """Join the process group `torchrun` describes in the environment; return True if this call created it.

    `device` is where this rank computes, as `polo.runtime.device.resolve_device` gives it (under
    torchrun, the GPU of the process's LOCAL_RANK: one GPU per rank); None is the CPU. The backend
    follows it (`backend_for`).

    Nothing happens in a plain single process (no `WORLD_SIZE`, or `WORLD_SIZE=1`) or when the
    caller already initialised a group; such a group must reduce CPU tensors (gloo, or a
    `cpu:gloo,...` backend), since polo's collective flags and counts live on the host.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    if dist.is_initialized():
        check_host_collectives()
        return False
    device = device if device is not None else torch.device("cpu")
    if device.type == "cuda":  # bind this rank to its GPU before NCCL creates its communicator
        torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device), device_id=device)
    else:
        dist.init_process_group(backend_for(device))
    return True


def leave_process_group(finished: bool) -> None:
    """Leave the process group `init_from_environment` joined; after a `finished` run, only once every rank is done.

    Without the barrier a rank that finishes first tears gloo down while its peer is still in its
    last collective or checkpoint write, and the peer can abort at exit ("terminate called without
    an active exception", SIGABRT; seen in a two-process `polo train` under the full test suite). A
    run that stopped on an error skips it: the other rank may never get there.
    """
    # Garbage held in reference cycles (a sharded model's DTensors and hooks, its device mesh) is freed here, on this
    # thread, while the interpreter is whole. Left to the collection at exit, a tensor that dies then can take the
    # group down with it during finalisation, when gloo's worker threads can no longer take the GIL; a thread that
    # tries is unwound mid-call and the process aborts as above (seen again after the barrier, once in a full suite).
    gc.collect()
    if finished:
        barrier()
    dist.destroy_process_group()


def check_host_collectives() -> None:
    """Raise ValueError when the initialised process group cannot reduce CPU tensors (a plain NCCL group)."""
    backend = str(dist.get_backend())
    if backend != "gloo" and "cpu:" not in backend and backend not in ("mpi", "ucc"):
        raise ValueError(
            f"the process group's backend is {backend!r}, which cannot reduce the CPU tensors polo's collectives use; "
            f"initialise it with backend {GPU_BACKEND!r} "
            "(or let polo do it: polo.runtime.parallel.init_from_environment)"
        )


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
    return bool(all_reduce_sum(torch.tensor(float(flag), device="cpu")).item() > 0)  # host scalar: gloo reduces it


def min_over_ranks(value: int) -> int:
    """Return the smallest `value` over all ranks."""
    if not is_distributed():
        return value
    tensor = torch.tensor(value, dtype=torch.int64, device="cpu")
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
    summed = all_reduce_sum(torch.tensor([float(values[key]) for key in keys], dtype=torch.float64, device="cpu"))
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
        elif key.endswith("tokens_per_second"):
            combined[key] = sum(values)
        else:
            combined[key] = sum(values) / len(values)
    return combined


def is_sharded(model: nn.Module) -> bool:
    """Return True for a model sharded by FSDP (`fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def model_device(model: nn.Module) -> torch.device:
    """Return the device of `model`'s first parameter (the CPU for a model without parameters)."""
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def shard_model(model: nn.Module) -> nn.Module:
    """Shard `model` across the ranks in place with FSDP: one unit per decoder layer, plus the rest at the root.

    The shards stay on the device the model is on (this rank's GPU, or the CPU): the mesh is
    built for that device type, since FSDP's default mesh would take a GPU whenever one is visible.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(
            f"train.data_parallel=fsdp needs a decoder with a `layers` list; {type(model).__name__} has none"
        )
    mesh = init_device_mesh(model_device(model).type, (world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data_parallel(module: nn.Module, find_unused_parameters: bool = False) -> nn.Module:
    """Return `module` wrapped in DistributedDataParallel on the device its parameters are on.

    On a GPU DDP is given that one device (`device_ids`, this rank's LOCAL_RANK GPU); on the CPU
    it takes none. Buffers are not re-broadcast before each forward (the models have no running
    statistics).
    """
    device = model_device(module)
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        module,
        device_ids=device_ids,
        find_unused_parameters=find_unused_parameters,
        forward_sync_buffers=False,
    )


@contextlib.contextmanager
def gathered_weights(model: nn.Module) -> Iterator[None]:
    """Hold the whole weights of an FSDP-sharded model on every rank for the duration (no-op otherwise).

    One all-gather up front; then forwards need no collective, so each rank can generate at
    its own pace (different completion lengths, different numbers of batches).
    """
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict]:
    """Return (model state dict or None, optimizer state dict) as a checkpoint stores them.

    For an FSDP-sharded model both are gathered whole onto the CPU (a collective: every rank
    calls it; rank 0 writes them). Otherwise the model's own weights are saved and the plain
    optimizer state dict is returned.
    """
    if not is_sharded(model):
        return None, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore an optimizer state written by `full_state_dicts` (each rank takes its own shard under FSDP)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def global_norm(norm: torch.Tensor) -> torch.Tensor:
    """Return a gradient norm as a plain tensor (FSDP's clip_grad_norm_ gives a replicated DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def is_main_process() -> bool:
    """Return True on rank 0 (or when torch.distributed is not initialised); only it writes."""
    return (
        not (torch.distributed.is_available() and torch.distributed.is_initialized())
        or torch.distributed.get_rank() == 0
    )
