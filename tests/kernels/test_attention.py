"""polo's attention: same results as transformers' SDPA; bf16 training off the bf16 flash kernel; block-wise over shared
prompts."""

from __future__ import annotations

import pytest
import torch

from polo.kernels.cpu.attention import POLO_ATTENTION, use_polo_attention
from polo.models.family import cache_keyword
from polo.models.loading import load_policy


def test_bf16_training_attention_matches_sdpa(tiny_model_dir):
    reference, _ = load_policy(str(tiny_model_dir))
    model, _ = load_policy(str(tiny_model_dir))
    for m in (reference, model):
        m.to(torch.bfloat16)
    assert use_polo_attention(model)
    assert model.config._attn_implementation == POLO_ATTENTION
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    with torch.no_grad():  # inference: bf16 eager attention, transformers' bf16 SDPA up to bf16 rounding
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=mask).logits.float(),
            reference(input_ids=ids, attention_mask=mask).logits.float(),
            rtol=0.02,
            atol=0.02,
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


def test_eager_attention_matches_fp32_sdpa_with_grouped_heads_and_an_empty_row():
    """bf16 eager attention: fp32 SDPA's output and gradients within bf16 rounding, zeros for a query with no key."""
    from polo.kernels.cpu.attention import eager_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, q_len, k_len, dim = 3, 6, 2, 5, 9, 16
    query = torch.randn(batch, heads, q_len, dim)
    key, value = torch.randn(2, batch, kv_heads, k_len, dim)
    mask = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    mask[1, ..., :3] = False  # left padding of row 1
    mask[2, :, 0] = False  # query 0 of row 2 may attend to nothing
    grad_out = torch.randn(batch, q_len, heads, dim)

    def run(fn, dtype):
        inputs = [x.to(dtype).detach().requires_grad_() for x in (query, key, value)]
        out = fn(*inputs)
        out.backward(grad_out.to(dtype))
        return out.float(), [x.grad.float() for x in inputs]

    def reference(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask, scale=0.2
        )
        return out.transpose(1, 2) * mask.any(-1).transpose(1, 2)[..., None]

    expected, expected_grads = run(reference, torch.float32)
    got, grads = run(lambda q, k, v: eager_attention(q, k, v, mask, 0.2), torch.bfloat16)
    assert got.shape == (batch, q_len, heads, dim)
    assert torch.equal(got[2, 0], torch.zeros(heads, dim))
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02)
    for ours, theirs in zip(grads, expected_grads):
        assert torch.isfinite(ours).all()
        assert (ours - theirs).norm() <= 0.01 * theirs.norm()
    fp32, _ = run(lambda q, k, v: eager_attention(q, k, v, mask, 0.2), torch.float32)
    torch.testing.assert_close(fp32, expected, rtol=1e-5, atol=1e-5)


def test_bf16_training_takes_eager_attention_only_where_its_scores_fit(monkeypatch):
    from polo.kernels.cpu import attention

    query, key = torch.zeros(2, 4, 8, 16), torch.zeros(2, 2, 8, 16)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    assert attention.eager_fits(query, key, mask)
    assert not attention.eager_fits(query, key, None)  # no mask: SDPA's causal path
    assert not attention.eager_fits(query, key, mask.float())
    monkeypatch.setattr(attention, "EAGER_SCORE_LIMIT", 2 * 4 * 8 * 8 - 1)
    assert not attention.eager_fits(query, key, mask)


def test_only_sdpa_models_are_switched(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir), attn_implementation="eager")
    assert not use_polo_attention(model)
    assert model.config._attn_implementation == "eager"


def test_decode_attention_folds_query_groups_and_matches_repeated_heads():
    """One query token over grouped key/value heads: the same as SDPA over repeated heads, with and without a mask."""
    from polo.kernels.cpu.attention import decode_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, length, head_dim = 4, 6, 2, 9, 8
    query = torch.randn(batch, heads, 1, head_dim)
    key_buffer, value_buffer = torch.randn(2, batch, kv_heads, 16, head_dim)
    key, value = key_buffer[:, :, :length], value_buffer[:, :, :length]  # a cache's filled part: strided views
    padded = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    padded[1, ..., :3] = False  # left padding of row 1
    for mask in (None, padded):
        expected = torch.nn.functional.scaled_dot_product_attention(
            query,
            key.repeat_interleave(heads // kv_heads, dim=1),
            value.repeat_interleave(heads // kv_heads, dim=1),
            attn_mask=mask,
            scale=0.3,
        ).transpose(1, 2)
        torch.testing.assert_close(decode_attention(query, key, value, mask, 0.3), expected, rtol=1e-5, atol=1e-6)


def test_decoding_with_polo_attention_matches_transformers(tiny_model_dir):
    """A cached decode step (one new token, grouped heads) gives transformers' SDPA logits, padded or not."""
    from transformers import DynamicCache

    reference, _ = load_policy(str(tiny_model_dir))
    model, _ = load_policy(str(tiny_model_dir))
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads: the folded path
    assert use_polo_attention(model)
    for padding in (0, 2):
        ids = torch.randint(0, model.config.vocab_size, (3, 6))
        mask = torch.ones_like(ids)
        mask[0, :padding] = 0
        logits = []
        with torch.no_grad():
            for m in (reference, model):
                with_cache = {cache_keyword(m): DynamicCache(config=m.config)}  # filled in place by the prefill
                m(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True, **with_cache)
                logits.append(m(input_ids=ids[:, -1:], attention_mask=mask, use_cache=True, **with_cache).logits)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize(
    "dtype, padding", [(torch.bfloat16, 2), (torch.bfloat16, 0), (torch.float32, 2), (torch.float32, 0)]
)
def test_a_decode_step_takes_polo_attention_and_matches_transformers(
    tiny_model_dir, monkeypatch, request, dtype, padding, native
):
    """On the CPU a cached one-token step goes to polo's native decode kernel (or, without it, `eager_attention`) in
    bf16 and fp32, with a left-padded row (a mask) or none (transformers passes no mask); its logits are SDPA's, up to
    bf16 rounding in bf16."""
    from transformers import DynamicCache

    from polo.kernels.cpu import attention

    if native:
        request.getfixturevalue("native_kernels")  # fails where a compiler exists and the kernels did not build
    else:
        monkeypatch.setattr(attention, "native_ops", lambda: None)
    taken, masks = [], []
    eager, native_decode = attention.eager_attention, attention.native_decode

    def eager_spy(*args):
        taken.append(("eager", args[0].shape))
        masks.append(args[3] is None)
        return eager(*args)

    def native_spy(query, keys, values, valid, shared, scaling):
        out = native_decode(query, keys, values, valid, shared, scaling)
        if out is not None:
            taken.append(("native", query.shape))
            masks.append(valid is None)
        return out

    monkeypatch.setattr(attention, "eager_attention", eager_spy)
    monkeypatch.setattr(attention, "native_decode", native_spy)
    reference, _ = load_policy(str(tiny_model_dir))
    model, _ = load_policy(str(tiny_model_dir))
    for m in (reference, model):
        m.to(dtype)
    assert use_polo_attention(model)
    ids = torch.randint(0, model.config.vocab_size, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :padding] = 0
    logits = []
    with torch.no_grad():
        for m in (reference, model):
            with_cache = {cache_keyword(m): DynamicCache(config=m.config)}
            m(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True, **with_cache)
            taken.clear()
            logits.append(m(input_ids=ids[:, -1:], attention_mask=mask, use_cache=True, **with_cache).logits.float())
    path = "native" if native else "eager"
    assert len(taken) == model.config.num_hidden_layers and all(kind == path and shape[2] == 1 for kind, shape in taken)
    assert all(masks) == (padding == 0)  # without padding the step has no mask, and polo's path takes it all the same
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(logits[1], logits[0], rtol=tolerance, atol=tolerance)


def test_query_key_scores_on_a_strided_cache_view_are_the_plain_product():
    """A decode step's scores (keys as the left operand, in bf16) are queries·keysᵀ, on a cache's strided view."""
    from polo.kernels.cpu.attention import query_key_scores

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        queries = torch.randn(4, 3, 3, 8, dtype=dtype)  # 3 query heads per key/value head, one token each
        keys = torch.randn(4, 3, 16, 8, dtype=dtype)[:, :, :11]  # the filled part of a 16-slot buffer
        scores = query_key_scores(queries, keys)
        assert scores.shape == (4, 3, 3, 11) and scores.is_contiguous()
        expected = torch.matmul(queries.float(), keys.float().transpose(-1, -2))
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # one bf16 rounding of an fp32 sum
        torch.testing.assert_close(scores.float(), expected, rtol=tolerance, atol=tolerance)
