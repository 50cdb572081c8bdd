"""One GRPO step on CUDA (polo's default precision there) equals the same step on the CPU in fp32, within bf16
tolerance."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import fixed_batch, one_step, run_config

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(
    "precision", ["auto", "bf16"]
)  # auto: bf16 weights + fp32 masters on a bf16 GPU; bf16: autocast
def test_one_grpo_step_on_cuda_equals_the_cpu_step(tiny_model_dir, tmp_path, monkeypatch, precision):
    from polo.models.loading import load_policy

    _, tokenizer = load_policy(str(tiny_model_dir))
    batch = fixed_batch(tokenizer)
    initial = {name: tensor.float() for name, tensor in load_policy(str(tiny_model_dir))[0].state_dict().items()}
    cpu_metrics, cpu_weights = one_step(run_config(tiny_model_dir, tmp_path / "cpu", "cpu", "fp32"), batch, monkeypatch)
    cuda_metrics, cuda_weights = one_step(
        run_config(tiny_model_dir, tmp_path / "cuda", "cuda", precision), batch, monkeypatch
    )

    # bf16 keeps 8 bits of mantissa: the loss and its statistics agree to about 1%.
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert cuda_metrics[key] == pytest.approx(cpu_metrics[key], rel=3e-2, abs=1e-3), key
    # Adam's first step moves each weight by about lr x sign(gradient): the two updates point the same way.
    cpu_update = torch.cat([(cpu_weights[name].float() - initial[name]).flatten() for name in sorted(cpu_weights)])
    cuda_update = torch.cat([(cuda_weights[name].float() - initial[name]).flatten() for name in sorted(cpu_weights)])
    assert cpu_update.abs().max() > 1e-4, "the CPU step barely moved the weights, so the comparison proves little"
    assert torch.nn.functional.cosine_similarity(cpu_update, cuda_update, dim=0) > 0.9
