"""polo's attention: same results as transformers' SDPA, fp32 while training in bf16, block-wise over shared prompts."""

from __future__ import annotations

import torch

from polo.kernels.cpu.attention import POLO_ATTENTION, use_polo_attention
from polo.models.loading import load_policy


def test_bf16_training_attention_computes_in_fp32_and_matches_sdpa(tiny_model_dir):
    reference, _ = load_policy(str(tiny_model_dir))
    model, _ = load_policy(str(tiny_model_dir))
    for m in (reference, model):
        m.to(torch.bfloat16)
    assert use_polo_attention(model)
    assert model.config._attn_implementation == POLO_ATTENTION
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    with torch.no_grad():  # inference: exactly transformers' bf16 SDPA
        assert torch.equal(
            model(input_ids=ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits
        )
    outputs = []
    for m in (reference, model):
        logits = m(input_ids=ids, attention_mask=mask).logits
        logits.float().pow(2).mean().backward()
        outputs.append((logits.detach().float(), [p.grad.float() for p in m.parameters()]))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=0.05, atol=0.05)
    for ours, theirs in zip(outputs[1][1], outputs[0][1]):
        assert torch.isfinite(ours).all()
        assert (ours - theirs).norm() <= 0.05 * theirs.norm() + 1e-6


def test_only_sdpa_models_are_switched(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir), attn_implementation="eager")
    assert not use_polo_attention(model)
    assert model.config._attn_implementation == "eager"
