"""torchrun on GPUs: 2 ranks over NCCL (one GPU each) reproduce the single-process update on one GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_helpers import fixed_batch, one_step, run_config, with_pythonpath

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]
WORKER = Path(__file__).with_name("nccl_worker.py")


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_two_nccl_ranks_update_equals_one_process(tiny_model_dir, tmp_path, monkeypatch, data_parallel):
    from polo.models.loading import load_policy

    _, tokenizer = load_policy(str(tiny_model_dir))
    batch = fixed_batch(tokenizer)
    torch.save(batch, tmp_path / "batch.pt")
    config = run_config(
        tiny_model_dir, tmp_path / "two", "cuda", "fp32", train={"data_parallel": data_parallel, "micro_batch_size": 4}
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        str(tmp_path / "batch.pt"),
        str(tmp_path / "config.json"),
        str(tmp_path / "two.pt"),
    ]
    result = subprocess.run(
        command, env=with_pythonpath(WORKER.parent, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "backend cpu:gloo,cuda:nccl" in result.stdout

    single_metrics, single = one_step(
        run_config(tiny_model_dir, tmp_path / "one", "cuda", "fp32", train={"micro_batch_size": 4}), batch, monkeypatch
    )
    parallel = torch.load(tmp_path / "two.pt")
    # An FSDP checkpoint also writes the tied lm_head.weight (the embedding again); every weight of one is in the other.
    assert single.keys() <= parallel["weights"].keys()
    for name, value in single.items():
        torch.testing.assert_close(parallel["weights"][name], value, atol=1e-5, rtol=0, msg=name)
    for key in ("loss", "entropy", "grad_norm"):
        assert parallel["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key
