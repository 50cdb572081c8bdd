"""The process group follows the device: gloo on the CPU, gloo + NCCL with one GPU per rank on CUDA.

The CUDA branches are exercised here with torch.distributed's and torch.cuda's entry points
recorded instead of called (this machine may have no GPU); tests/cuda runs them for real.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from polo.runtime import parallel


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """Two ranks announced by torchrun's environment, with no group yet; what init would call is recorded."""
    calls: dict = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **options: calls.update(backend=backend, **options))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(set_device=device))
    return calls


def test_the_backend_follows_the_device():
    assert parallel.backend_for(torch.device("cpu")) == "gloo"
    assert parallel.backend_for(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"


def test_a_cuda_rank_binds_its_gpu_and_reduces_host_tensors_with_gloo(recorded):
    gpu = torch.device("cuda", 1)  # LOCAL_RANK 1's GPU, as resolve_device gives it
    assert parallel.init_from_environment(gpu)
    assert recorded == {"backend": "cpu:gloo,cuda:nccl", "device_id": gpu, "set_device": gpu}


def test_a_cpu_rank_gets_gloo(recorded):
    assert parallel.init_from_environment(torch.device("cpu"))
    assert recorded == {"backend": "gloo"}
    recorded.clear()
    assert parallel.init_from_environment()  # no device: the CPU
    assert recorded == {"backend": "gloo"}


def test_a_single_process_joins_no_group(recorded, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE")
    assert not parallel.init_from_environment(torch.device("cuda", 0))
    assert recorded == {}


def test_a_group_that_cannot_reduce_host_tensors_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match=r"backend is 'nccl'.*'cpu:gloo,cuda:nccl'"):
        parallel.init_from_environment(torch.device("cuda", 0))
    for usable in ("gloo", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=usable: backend)
        assert not parallel.init_from_environment(torch.device("cuda", 0))  # the caller's group is used as it is


def test_ddp_is_given_the_parameters_gpu(monkeypatch):
    built = []
    monkeypatch.setattr(
        nn.parallel, "DistributedDataParallel", lambda module, **options: built.append(options) or module
    )
    parallel.data_parallel(nn.Linear(2, 2), find_unused_parameters=True)
    monkeypatch.setattr(parallel, "model_device", lambda module: torch.device("cuda", 3))
    parallel.data_parallel(nn.Linear(2, 2))
    assert [options["device_ids"] for options in built] == [None, [3]]
    assert built[0]["find_unused_parameters"] and not built[1]["find_unused_parameters"]


def test_fsdp_shards_onto_a_mesh_of_the_models_device(monkeypatch, tiny_model_dir):
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp

    from polo.models.loading import load_policy

    model, _ = load_policy(str(tiny_model_dir))
    meshes, sharded = [], []
    monkeypatch.setattr(
        device_mesh, "init_device_mesh", lambda device_type, shape: meshes.append((device_type, shape)) or device_type
    )
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, mesh: sharded.append((type(module).__name__, mesh)))
    monkeypatch.setattr(parallel, "model_device", lambda module: torch.device("cuda", 0))
    parallel.shard_model(model)
    assert meshes == [("cuda", (1,))]
    assert sharded == [("LlamaDecoderLayer", "cuda")] * 2 + [("LlamaForCausalLM", "cuda")]
