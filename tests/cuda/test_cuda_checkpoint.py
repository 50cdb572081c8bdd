"""Checkpoints are device-free: a CUDA run resumes in a process that sees no GPU, and a CPU run resumes on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_helpers import run_config, with_pythonpath

pytestmark = pytest.mark.cuda

RESUME = (
    "import json, sys; from polo.rl.train import train; train(json.load(open(sys.argv[1])), ['output.resume=true'])"
)


def train_in_subprocess(
    config: dict, config_path: Path, resume: bool, **environment: str
) -> subprocess.CompletedProcess:
    """Run (or resume) `polo.rl.train.train(config)` in a fresh python with `environment` added."""
    config_path.write_text(json.dumps(config))
    code = RESUME if resume else RESUME.replace(", ['output.resume=true']", "")
    env = with_pythonpath(Path(__file__).parent, **environment)
    return subprocess.run(
        [sys.executable, "-c", code, str(config_path)], env=env, capture_output=True, text=True, timeout=600
    )


def steps_logged(output_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if "loss" in row]


def test_a_cuda_checkpoint_resumes_where_no_gpu_is_visible(tiny_model_dir, tmp_path):
    output_dir = tmp_path / "run"
    on_gpu = run_config(tiny_model_dir, output_dir, "cuda", "bf16", train={"steps": 2}, output={"save_every": 2})
    first = train_in_subprocess(on_gpu, tmp_path / "gpu.json", resume=False)
    assert first.returncode == 0, first.stderr[-4000:]
    state = torch.load(
        output_dir / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False
    )  # here a GPU exists
    assert "cuda" in state["rng"], "a CUDA run saves its GPUs' RNG states"
    assert any(
        value.device.type == "cuda"
        for slot in state["optimizer"]["state"].values()
        for value in slot.values()
        if isinstance(value, torch.Tensor)
    ), "the optimizer state was written from the GPU, so loading it needs map_location"

    on_cpu = run_config(tiny_model_dir, output_dir, "cpu", "bf16", train={"steps": 3}, output={"save_every": 3})
    resumed = train_in_subprocess(
        on_cpu, tmp_path / "cpu.json", resume=True, CUDA_VISIBLE_DEVICES=""
    )  # a machine without a GPU
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert steps_logged(output_dir) == [1, 2, 3]
    final = torch.load(
        output_dir / "checkpoints" / "step-000003" / "trainer_state.pt", map_location="cpu", weights_only=False
    )
    assert final["step"] == 3 and "cuda" not in final["rng"]


def test_a_cpu_checkpoint_resumes_on_cuda(tiny_model_dir, tmp_path):
    from polo.rl.train import train

    output_dir = tmp_path / "run"
    train(run_config(tiny_model_dir, output_dir, "cpu", "fp32", train={"steps": 2}, output={"save_every": 2}))
    result = train(
        run_config(tiny_model_dir, output_dir, "cuda", "fp32", train={"steps": 3}, output={"save_every": 3}),
        ["output.resume=true"],
    )
    assert [row["step"] for row in result.metrics if "loss" in row] == [1, 2, 3]
    state = torch.load(
        output_dir / "checkpoints" / "step-000003" / "trainer_state.pt", map_location="cpu", weights_only=False
    )
    assert "cuda" in state["rng"]
