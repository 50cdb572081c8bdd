"""polo's native decode attention (`torch.ops.polo_native.decode_attention`) against the torch paths it replaces."""

from __future__ import annotations

import pytest
import torch

from polo.kernels.cpu.attention import eager_attention, native_decode, shared_prompt_decode
from polo.kernels.cpu.kv_cache import SharedPrompt

# The expected values are the torch path's in fp32, from the same (bf16-valued) inputs: the native kernel keeps its
# scores and weights in fp32, so in bf16 it differs from them by the output's rounding (an ulp: 2^-8 relative).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def cache_view(rows: int, kv_heads: int, length: int, dim: int, dtype: torch.dtype):
    """Return keys and values as a sampling cache holds them: the filled part of a larger buffer (strided)."""
    keys = torch.randn(rows, kv_heads, length + 9, dim, dtype=dtype)
    values = torch.randn(rows, kv_heads, length + 9, dim, dtype=dtype)
    return keys[:, :, :length], values[:, :, :length]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, kv_heads, dim",
    [(9, 3, 64), (8, 2, 128), (14, 2, 64), (4, 4, 48), (6, 2, 20)],  # fast paths, 7 heads a kv head, generic dims
)
def test_plain_rows_match_eager_attention(native_kernels, dtype, heads, kv_heads, dim):
    torch.manual_seed(0)
    rows, length = 5, 23
    query = torch.randn(rows, heads, 1, dim, dtype=dtype)
    keys, values = cache_view(rows, kv_heads, length, dim, dtype)
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding
    mask[3, ..., :1] = False
    with torch.no_grad():
        expected = eager_attention(query.float(), keys.float(), values.float(), mask, None).to(dtype)
        got = native_decode(query, keys[:, :, None], values[:, :, None], mask[:, 0, 0], None, None)
        unmasked = native_decode(query, keys[:, :, None], values[:, :, None], None, None, 0.3)
        expected_unmasked = eager_attention(query.float(), keys.float(), values.float(), None, 0.3).to(dtype)
    assert got.shape == (rows, 1, heads, dim) and got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    torch.testing.assert_close(unmasked, expected_unmasked, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 40])
def test_shared_prompts_match_the_torch_shared_decode(native_kernels, dtype, dim):
    torch.manual_seed(1)
    prompts, group, kv_heads, heads, prompt_length, own = 3, 4, 3, 9, 11, 6
    prompt_keys = torch.randn(prompts, kv_heads, prompt_length, dim, dtype=dtype)
    prompt_values = torch.randn(prompts, kv_heads, prompt_length, dim, dtype=dtype)
    prompt_mask = torch.ones(prompts, prompt_length, dtype=torch.long)
    prompt_mask[1, :5] = 0  # a shorter prompt, left-padded
    steps = [torch.randn(2, prompts * group, kv_heads, 1, dim, dtype=dtype) for _ in range(own)]
    query = torch.randn(prompts * group, heads, 1, dim, dtype=dtype)
    caches = {}
    for precision in (dtype, torch.float32):  # the same cache in the inputs' dtype and in fp32 (the expected values)
        shared = SharedPrompt(prompt_keys.to(precision), prompt_values.to(precision), prompt_mask, group, own + 4)
        for keys, values in steps:  # the rows' own tokens, one decode step at a time
            own_keys, own_values = shared.append(keys.to(precision), values.to(precision))
        caches[precision] = shared, own_keys, own_values
    with torch.no_grad():
        shared, own_keys, own_values = caches[torch.float32]
        expected = shared_prompt_decode(query.float(), own_keys, own_values, shared, None).to(dtype)
        shared, own_keys, own_values = caches[dtype]
        got = native_decode(query, own_keys, own_values, None, shared, None)
    torch.testing.assert_close(got, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_a_row_that_sees_nothing_gets_zeros_and_the_others_are_untouched(native_kernels):
    torch.manual_seed(2)
    query = torch.randn(2, 4, 1, 64)
    keys, values = cache_view(2, 2, 7, 64, torch.float32)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[0] = False
    with torch.no_grad():
        got = native_decode(query, keys[:, :, None], values[:, :, None], valid, None, None)
        alone = native_decode(query[1:], keys[1:, :, None], values[1:, :, None], None, None, None)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got[1:], alone)


def test_it_declines_what_it_does_not_compute(native_kernels):
    """With a gradient, in float64, with mixed dtypes, or off a whole number of query heads per key/value head,
    the torch path runs."""
    query = torch.randn(2, 4, 1, 64)
    keys, values = cache_view(2, 2, 5, 64, torch.float32)
    with torch.no_grad():
        assert (
            native_decode(query.double(), keys.double()[:, :, None], values.double()[:, :, None], None, None, None)
            is None
        )
        assert native_decode(query[:, :3], keys[:, :, None], values[:, :, None], None, None, None) is None
        bf16 = keys.bfloat16()[:, :, None]
        assert native_decode(query, bf16, bf16, None, None, None) is None  # an fp32 query over a bf16 cache
    with torch.enable_grad():
        assert native_decode(query, keys[:, :, None], values[:, :, None], None, None, None) is None


def test_without_the_native_library_polo_keeps_its_torch_path(monkeypatch):
    from polo.kernels.cpu import attention

    monkeypatch.setattr(attention, "native_ops", lambda: None)
    query = torch.randn(2, 4, 1, 64)
    keys, values = cache_view(2, 2, 5, 64, torch.float32)
    with torch.no_grad():
        assert attention.native_decode(query, keys[:, :, None], values[:, :, None], None, None, None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_rows", [None, 1, 3])  # no mask, one mask for every row, a mask per row
def test_the_native_masked_softmax_and_its_gradient_match_torchs(native_kernels, monkeypatch, dtype, mask_rows):
    from polo.kernels.cpu import attention

    torch.manual_seed(3)
    scores = torch.randn(3, 4, 5, 86, dtype=dtype)  # 86 keys: not a whole number of vectors
    mask = None
    if mask_rows is not None:
        mask = torch.rand(mask_rows, 1, 5, 86) > 0.3
        mask[..., 0] = True  # every query sees a key (an empty row is the next test's)
    grad = torch.randn_like(scores)
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(attention, "native_ops", lambda: None)
        leaf = scores.clone().requires_grad_()
        weights = attention.masked_softmax(leaf, mask)
        weights.backward(grad)
        results.append((weights.detach(), leaf.grad))
    (native_weights, native_grad), (torch_weights, torch_grad) = results
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # sums in another order; bf16: an ulp of a weight < 1
    torch.testing.assert_close(native_weights, torch_weights, rtol=0, atol=tolerance)
    torch.testing.assert_close(native_grad, torch_grad, rtol=tolerance, atol=tolerance)
    if mask is not None:
        assert torch.all(native_weights.masked_select(~mask.expand(3, 1, 5, 86).expand(3, 4, 5, 86)) == 0)


def test_a_query_that_sees_no_key_gets_zero_weights_natively(native_kernels):
    from polo.kernels.cpu.attention import masked_softmax

    scores = torch.randn(2, 3, 4, 40)
    mask = torch.ones(2, 1, 4, 40, dtype=torch.bool)
    mask[1, 0, 2] = False
    weights = masked_softmax(scores, mask)
    assert torch.equal(weights[1, :, 2], torch.zeros(3, 40))
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(3, 4))
