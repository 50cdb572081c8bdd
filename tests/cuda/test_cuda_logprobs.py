"""Chunked lm_head log-probs on CUDA equal the full-logits ones, without ever holding the fp32 logits."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


def full_logits_reference(hidden, weight, targets, temperature):
    """Return (log-probs, entropy) from the whole (batch, seq, V) fp32 logits."""
    logprobs = torch.log_softmax((hidden.float() @ weight.float().T) / temperature, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_chunked_logprobs_and_gradients_equal_full_logits_on_cuda(dtype, tolerance):
    from polo.kernels.logprobs import LogprobSettings, token_logprobs

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(2, 50, 64, device=device, generator=generator).to(dtype)
    weight = (torch.randn(1000, 64, device=device, generator=generator) * 0.3).to(dtype)
    targets = torch.randint(0, 1000, (2, 50), device=device, generator=generator)
    upstream = torch.randn(2, 50, device=device, generator=generator)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.float().clone().requires_grad_(), weight.float().clone().requires_grad_()

    logprobs, entropy = token_logprobs(
        h1, w1, targets, LogprobSettings(temperature=0.7, chunk_size=16, vocab_block=128, with_entropy=True)
    )
    reference, reference_entropy = full_logits_reference(h2, w2, targets, 0.7)
    assert logprobs.device.type == "cuda" and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, reference, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(entropy, reference_entropy.detach(), atol=tolerance, rtol=tolerance)
    (logprobs * upstream).sum().backward()
    (reference * upstream).sum().backward()
    torch.testing.assert_close(h1.grad.float(), h2.grad, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(w1.grad.float(), w2.grad, atol=tolerance, rtol=tolerance)


def test_chunked_logprobs_never_hold_the_fp32_logits_on_cuda():
    from polo.kernels.logprobs import LogprobSettings, token_logprobs

    device = torch.device("cuda")
    tokens, vocab, width = 4096, 49152, 64  # SmolLM2's vocabulary: full fp32 logits would be 768 MiB
    hidden = torch.randn(1, tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (1, tokens), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    logprobs, _ = token_logprobs(hidden, weight, targets, LogprobSettings(chunk_size=512, with_entropy=True))
    logprobs.sum().backward()
    torch.cuda.synchronize()
    full_logits_bytes = tokens * vocab * 4
    assert torch.cuda.max_memory_allocated() - baseline < full_logits_bytes / 2


def test_fused_completion_logprobs_equal_the_model_logits_on_cuda(tiny_model_dir):
    from polo.kernels.logprobs import LogprobSettings, completion_logprobs_fused, supports_fused_logprobs
    from polo.models.loading import load_policy

    model, _ = load_policy(str(tiny_model_dir))
    model = model.to("cuda").eval()
    assert supports_fused_logprobs(model)
    generator = torch.Generator(device="cuda").manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (3, 20), device="cuda", generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # one left-padded row
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    completion_len = 7
    with torch.no_grad():
        logprobs, entropy = completion_logprobs_fused(
            model,
            input_ids,
            attention_mask,
            position_ids,
            input_ids[:, -completion_len:],
            LogprobSettings(with_entropy=True),
        )
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    full = torch.log_softmax(logits[:, -completion_len - 1 : -1], dim=-1)
    reference = full.gather(-1, input_ids[:, -completion_len:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1), atol=1e-4, rtol=1e-4)
