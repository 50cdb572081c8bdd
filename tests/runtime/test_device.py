"""One `Compute` per run: precision names, the device spec, and what is asked of the hardware."""

from __future__ import annotations

import pytest
import torch

from polo.config import ConfigError, load_config
from polo.runtime.device import (
    CPU,
    PRECISIONS,
    Compute,
    autocast_compute,
    memory_metrics,
    resolve_device,
    train_compute,
)


@pytest.mark.parametrize("name", PRECISIONS)
def test_a_precision_name_round_trips_through_compute(name):
    compute = Compute.named(name, "cpu")
    assert compute.precision == name and str(compute) == f"{name} on cpu"
    assert compute.frozen_dtype == (None if name == "fp32" else torch.bfloat16)  # the reference is bf16 under any bf16
    assert compute.master_weights == (name == "bf16_master")


def test_autocast_is_on_the_run_device_only_when_chosen():
    with Compute.named("bf16", "cpu").autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with CPU.autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_the_device_spec_resolves_or_names_what_is_accepted():
    assert resolve_device("cpu") == CPU.device and resolve_device(" CPU ") == CPU.device
    with pytest.raises(ConfigError, match="not one of: auto | cpu | cuda | cuda:N"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == CPU.device
        with pytest.raises(ConfigError, match="sees no CUDA GPU"):
            resolve_device("cuda:0")


def test_a_bad_device_is_a_config_error_before_anything_loads():
    from polo.finetune.sft import load_sft_config

    with pytest.raises(ConfigError, match="train.device: 'gpu' is not one of auto, cpu, cuda, cuda:N"):
        load_config({"train": {"device": "gpu"}})
    with pytest.raises(ConfigError, match="train.device: 'cuda:x'"):
        load_sft_config({"data": {"train_path": "x.jsonl"}, "train": {"device": "cuda:x"}})
    assert train_compute(load_config({"train": {"device": "cpu", "precision": "fp32"}})) == CPU
    assert autocast_compute("fp32", "cpu") == CPU


def test_memory_metrics_are_for_cuda_only():
    assert memory_metrics(CPU) == {}
