"""polo's attention: transformers' SDPA, plus fp32 compute for bf16 training on the CPU and block-wise shared prompts.

Registered with transformers as the attention implementation "polo_sdpa" (with SDPA's mask
builder), so a model switched to it by `use_polo_attention` gets the same masks and the same
maths as "sdpa", with two differences that only change speed:

- In bf16 on the CPU, attention does not use the CPU's bf16 flash kernel, whose backward is slow
  (for 32 sequences x 148 tokens x 9 heads of SmolLM2-135M, 74 ms per layer against 26 ms in
  fp32) and whose forward is no faster than fp32's. With a boolean mask and a score matrix that
  fits `EAGER_SCORE_LIMIT`, it is computed as bf16 matmuls around a softmax (`eager_attention`, the
  maths of transformers' eager attention): 2-3x faster than fp32 flash in training, and 1.7x
  faster than bf16 flash when scoring without a gradient (the reference's 32 x 64 queries over
  148 keys: 4.3 against 7.3 ms a layer), and 2x faster for a one-token decode step (64 rows over
  70 cached keys: 173 against 355 us a layer through `decode_attention`'s SDPA). Otherwise
  training attention runs in fp32 through SDPA and inference in bf16 SDPA. A decode step (one query,
  no gradient) takes polo's native kernel where it is built (`native_decode`: the cache read in place,
  3x faster than `eager_attention`), else `eager_attention`, in fp32 too, with or without a mask
  (`decode_step`).
- Given `shared_layout` (polo.kernels.cpu.shared_prompt, passed through the model's forward kwargs), it
  attends block by block and skips the blocks of the shared-prompt mask that are all False.
- Given `prompt_cache` (a sampling cache whose prompts `polo.kernels.cpu.kv_cache.share_prompt` holds
  once per group of samples), a decode step reads each prompt's keys/values once for its whole group
  (`native_decode`, else `shared_prompt_decode`).
- With grouped-query attention (fewer key/value heads than query heads) and a boolean mask on
  the CPU, it asks SDPA for GQA (`enable_gqa`) instead of copying every key/value head G times
  as transformers does whenever a mask is given. For SmolLM2-135M (9 query, 3 key/value heads)
  in the shared layout, forward + backward of one layer went from 33 to 16 ms; the copies and
  their zero-filled gradients had cost ~1.9 s of a 17 s profiled GRPO step.
"""

from __future__ import annotations

import torch

from polo.kernels.cpu import shared_prompt
from polo.kernels.cpu.native import native_ops

__all__ = ["POLO_ATTENTION", "polo_attention", "use_polo_attention"]

POLO_ATTENTION = "polo_sdpa"


def polo_attention(module, query, key, value, attention_mask, *args, shared_layout=None, prompt_cache=None, **kwargs):
    """Return (output (batch, len, heads, d), None): transformers' attention interface, (module, q, k, v, mask, ...)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shared = None if prompt_cache is None else prompt_cache.layers[module.layer_idx].shared
    if shared is not None:
        if not plain_call(query, shared.prompt_keys, args, kwargs) or query.shape[-2] != 1:
            raise ValueError("a cache holding shared prompts takes only plain one-token decode steps")
        native = native_decode(query, key, value, None, shared, kwargs.get("scaling"))
        return (
            shared_prompt_decode(query, key, value, shared, kwargs.get("scaling")) if native is None else native
        ), None

    dtype = query.dtype
    bf16_cpu = dtype == torch.bfloat16 and query.device.type == "cpu"
    upcast = bf16_cpu and torch.is_grad_enabled()

    def sdpa(q, k, v, mask):
        if one_query_over_groups(module, q, k, mask, args, kwargs):
            return decode_attention(q, k, v, mask, kwargs.get("scaling"))
        if gqa_without_copies(module, q, k, mask, args, kwargs):
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=kwargs.get("dropout", 0.0),
                scale=kwargs.get("scaling"),
                enable_gqa=True,
            )
            return out.transpose(1, 2).contiguous()
        return sdpa_attention_forward(module, q, k, v, mask, *args, **kwargs)[0]

    def attend(q, k, v, mask):
        # eager wherever it fits: in bf16 on the CPU for training, scoring and decoding; in any dtype for a decode step
        eager = bf16_cpu or decode_step(q)
        if eager and eager_fits(q, k, mask) and plain_call(q, k, args, kwargs) and not kwargs.get("dropout"):
            return eager_or_native(q, k, v, mask, kwargs.get("scaling"))
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
            if mask is not None and mask.is_floating_point():
                mask = mask.float()
            with torch.autocast("cpu", enabled=False):
                return sdpa(q, k, v, mask).to(dtype)
        return sdpa(q, k, v, mask)

    if shared_layout is not None:
        return shared_prompt.shared_attention(attend, query, key, value, shared_layout), None
    return attend(query, key, value, attention_mask), None


# Keyword arguments of transformers' attention call that SDPA-with-GQA handles exactly as its
# sdpa_attention_forward does (the mask already carries causality, padding and any sliding window),
# and the flags a model's forward hands down to every layer that only say what it returns: a
# mixture-of-experts model passes `output_router_logits` to its attention too.
_PLAIN_KWARGS = {
    "dropout",
    "scaling",
    "is_causal",
    "position_ids",
    "sliding_window",
    "output_attentions",
    "output_hidden_states",
    "output_router_logits",
    "return_dict",
    "use_cache",
    "cache_position",
}


# The most score entries (batch x heads x q_len x k_len) one eager attention call may hold: its
# backward keeps the bf16 weights, 2 bytes an entry per layer (64 MiB here), where flash keeps none.
EAGER_SCORE_LIMIT = 32 * 1024 * 1024


def eager_fits(query: torch.Tensor, key: torch.Tensor, mask) -> bool:
    """Return whether `eager_attention` takes this call: a boolean mask (or none for a `decode_step`), at most
    `EAGER_SCORE_LIMIT` score entries."""
    batch, heads, q_len, _ = query.shape
    if mask is None:
        masked = decode_step(query)  # one query with nothing to hide; a longer query without a mask is causal
    else:
        masked = isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
    return masked and batch * heads * q_len * key.shape[-2] <= EAGER_SCORE_LIMIT


def decode_step(query: torch.Tensor) -> bool:
    """Return whether this is a sampling step on the CPU: one query token per row and no gradient.

    Such a step goes to `eager_attention` in any dtype: for SmolLM2-135M's 64 rows over 70 cached keys
    one layer took 163 against 376 us through `decode_attention`'s SDPA in bf16, and 225 against 533
    us in fp32; 25 rows over 140 keys, 183 against 245 (bf16) and 194 against 267 us (fp32); about even
    at 8 rows over 200 (117 against 104 in bf16, 108 against 110 in fp32; torch 2.13).
    """
    return query.device.type == "cpu" and query.shape[-2] == 1 and not torch.is_grad_enabled()


def eager_attention(query, key, value, mask, scaling: float | None) -> torch.Tensor:
    """Return softmax(q·Kᵀ·scale, masked)·V as matmuls in the inputs' dtype, (batch, q_len, heads, d).

    query (batch, heads, q_len, d); key, value (batch, kv_heads, k_len, d); mask (batch or 1, 1,
    q_len, k_len) bool, True where a query may attend, or None for a decode step that sees every
    key. The query heads that share a key/value head are stacked as the rows of one product, so
    keys and values are never repeated. A masked score is the dtype's lowest value (added as a
    bias), not -inf (no NaN), and a query with nothing to attend to (left
    padding) gets zeros, as from SDPA; a decode step (one query, no gradient) skips that check, since
    its query always sees its own just-cached key. For bf16 training on the CPU: forward and
    backward of SmolLM2-135M's completion block (32 rows x 40 queries over 142 keys) took 7.7 ms per
    layer against 14.8 ms in fp32 flash attention and 23 ms in bf16 flash; gradients within 0.5 %
    (relative norm) of fp32's (torch 2.13).
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[-2]
    per_kv = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    stacked = (query * scale).reshape(batch, kv_heads, per_kv * q_len, dim)
    scores = query_key_scores(stacked, key).view(batch, heads, q_len, k_len)
    weights = masked_softmax(scores, mask).view(batch, kv_heads, per_kv * q_len, k_len)
    out = torch.matmul(weights, value).view(batch, heads, q_len, dim).transpose(1, 2)
    if mask is None or (q_len == 1 and not torch.is_grad_enabled()):  # a decode step sees at least its own new key
        return out.contiguous()
    attends = mask.any(dim=-1).transpose(1, 2)[..., None]  # (batch or 1, q_len, 1, 1)
    return (out * attends).contiguous()


def eager_or_native(query, key, value, mask, scaling: float | None) -> torch.Tensor:
    """Return `eager_attention(...)`, or for a decode step (`decode_step`) the same from polo's native kernel where it
    runs (`native_decode`)."""
    if decode_step(query):
        valid = None if mask is None else mask[:, 0, 0, :].expand(query.shape[0], -1)
        native = native_decode(query, key[:, :, None], value[:, :, None], valid, None, scaling)
        if native is not None:
            return native
    return eager_attention(query, key, value, mask, scaling)


def masked_softmax(scores: torch.Tensor, mask) -> torch.Tensor:
    """Return softmax(scores) over the last dim with the keys `mask` hides left out, (batch, heads, q, k).

    scores (batch, heads, q, k); mask (batch or 1, 1, q, k) bool, True where a query may attend, or
    None. polo's native kernel (`MaskedSoftmax`) where it runs, else torch's softmax after a bias of
    the dtype's lowest value; they differ only on a row that sees nothing (zeros natively, uniform
    weights here), whose output `eager_attention` zeroes either way.
    """
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.bfloat16) and native_ops() is not None:
        return MaskedSoftmax.apply(scores, None if mask is None else mask[:, 0])
    if mask is not None:
        # An additive bias, built at the mask's size, rather than `scores.masked_fill(~mask, min)`: the same
        # scores, and a plain add has no backward of its own. For 64 rows x 32 queries over 86 keys in
        # bf16 one layer's attention took 6.4-8.1 ms forward with the masked fill, 2.6-3.0 ms this way.
        scores = scores + scores.new_zeros(mask.shape).masked_fill_(mask.logical_not(), torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1)


class MaskedSoftmax(torch.autograd.Function):
    """softmax(scores) over keys a mask may hide, in polo's native kernel: the bias and the softmax in one pass.

    forward(scores (batch, heads, q, k), mask (batch or 1, q, k) bool or None) -> weights, same shape
    and dtype, computed in fp32 and rounded once, as torch's softmax does. Backward is torch's
    softmax backward from the saved weights (a hidden key's weight is 0, and so its gradient). In bf16
    64 x 9 x 32 rows over 86 keys took 0.77 ms against 1.78 ms for torch's softmax alone.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        weights = native_ops().masked_softmax(scores, mask)
        ctx.save_for_backward(weights)
        return weights

    @staticmethod
    def backward(ctx, grad_weights: torch.Tensor):
        (weights,) = ctx.saved_tensors
        return torch.ops.aten._softmax_backward_data(grad_weights, weights, -1, weights.dtype), None


def query_key_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Return queries·keysᵀ, (..., q, k), for queries (..., q, d) and keys (..., k, d) with the same leading dims.

    For a few bf16 query rows (a decode step) it is computed as (keys·queriesᵀ)ᵀ, the same numbers. The
    keys there are a cache's filled part, a strided view, which torch's oneDNN matmul copies into a
    contiguous tensor first; as the left operand they are copied as they lie, as the right operand
    (keysᵀ) transposed, which is slower. For 64 rows x 3 kv heads over 100 of 160 cached positions
    (SmolLM2-135M), 114 against 274 us a layer; 25 rows over 140, 74 against 158 (torch 2.13).
    fp32 goes to MKL, which reads the strides as they are.
    """
    if queries.dtype == torch.bfloat16 and queries.device.type == "cpu" and queries.shape[-2] <= 16:
        return torch.matmul(keys, queries.transpose(-1, -2)).transpose(-1, -2).contiguous()  # small: q rows x k
    return torch.matmul(queries, keys.transpose(-1, -2))


def plain_call(query: torch.Tensor, key: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Return whether this attention call is plain attention on the CPU.

    (batch, heads, len, d) tensors, a whole number of query heads per key/value head, and no extra
    terms (softcapping, position bias, attention sinks, ...) in the call.
    """
    return (
        query.device.type == "cpu"
        and query.dim() == 4
        and key.dim() == 4
        and query.shape[-3] % key.shape[-3] == 0
        and not args
        and all(name in _PLAIN_KWARGS or value is None for name, value in kwargs.items())
    )


def plain_grouped_call(module, query: torch.Tensor, key: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Return whether this attention call is plain grouped-query attention on the CPU (`plain_call` with more query
    than key/value heads)."""
    groups = getattr(module, "num_key_value_groups", 1)
    return groups > 1 and query.shape[-3] == key.shape[-3] * groups and plain_call(query, key, args, kwargs)


def gqa_without_copies(module, query: torch.Tensor, key: torch.Tensor, mask, args: tuple, kwargs: dict) -> bool:
    """Return whether this attention call can go to SDPA with `enable_gqa` (as if the key/value heads were repeated).

    Only for a plain call (`plain_grouped_call`) of more than one query token with a boolean mask
    (so transformers would not use is_causal).
    """
    return (
        plain_grouped_call(module, query, key, args, kwargs)
        and query.shape[-2] > 1  # one query token: transformers already folds the heads without copies
        and isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
    )


def one_query_over_groups(module, query: torch.Tensor, key: torch.Tensor, mask, args: tuple, kwargs: dict) -> bool:
    """Return whether this is a decode step (one query token) of grouped-query attention for `decode_attention`.

    Only for a plain call (`plain_grouped_call`) with a mask shared by every head (or none).
    """
    return (
        plain_grouped_call(module, query, key, args, kwargs)
        and query.shape[-2] == 1
        and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 1))
    )


def decode_attention(query, key, value, mask, scaling: float | None) -> torch.Tensor:
    """Return attention for one query token per row, (batch, 1, heads, d), each key/value head's queries as its rows.

    query (batch, heads, 1, d); key, value (batch, kv_heads, len, d); mask None or (batch, 1, 1, len).
    The G query heads that share a key/value head become G query rows of that head, so SDPA runs
    on (batch, kv_heads, G, d) without repeating keys and values. transformers does this only when
    a mask is given; without one it asks SDPA for `enable_gqa`, whose CPU kernel took 1.9 ms per
    layer for 32 rows x 130 cached tokens of SmolLM2-135M against 0.38 ms this way (torch 2.13):
    over half of a 64-token rollout.
    """
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    packed = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, heads, head_dim)


def shared_prompt_decode(query, own_keys, own_values, shared, scaling: float | None) -> torch.Tensor:
    """Return attention for one query token per row over its group's prompt and its own tokens, (batch, 1, heads, d).

    query (batch, heads, 1, d), batch = P prompts x G rows, a group's rows consecutive; own_keys,
    own_values (P, kv_heads, G, len, d): each row's own tokens; `shared`
    (polo.kernels.cpu.kv_cache.SharedPrompt): prompt_keys, prompt_values (P, kv_heads, prompt_len, d)
    and prompt_bias (P·kv_heads, 1, prompt_len). The result is softmax([q·K_prompt·scale + bias,
    q·K_own·scale])·[V_prompt; V_own], the maths of attending over the prompt repeated per row, but
    each prompt's keys and values are read once per group: a group's G rows (times the query heads
    that share a key/value head) are the rows of one matmul. Scores are matmul outputs in the
    inputs' dtype, the softmax accumulates in fp32, as in transformers' eager attention. One layer
    for 8 prompts x 8 rows of SmolLM2-135M over a 102-token prompt took 268 us against 497 us for
    SDPA over the prompt repeated per row; 12 x 16 rows, 613 against 2,210 us (torch 2.13,
    bf16): a decode step's attention reads the cache from memory and does little else.
    """
    batch, heads, _, dim = query.shape
    prompts, kv_heads, group, length, _ = own_keys.shape
    per_kv, prompt_length = heads // kv_heads, shared.prompt_length
    scale = dim**-0.5 if scaling is None else scaling
    # (P·kv_heads, G·per_kv, d): each group's queries as the rows of one product with its prompt
    grouped = query.view(prompts, group, kv_heads, per_kv, dim).transpose(1, 2).mul(scale)
    grouped = grouped.reshape(prompts * kv_heads, group * per_kv, dim)
    prompt_keys = shared.prompt_keys.view(prompts * kv_heads, prompt_length, dim)
    prompt_scores = torch.baddbmm(shared.prompt_bias, grouped, prompt_keys.transpose(1, 2))
    own_scores = query_key_scores(grouped.view(prompts, kv_heads, group, per_kv, dim), own_keys)
    own_scores = own_scores.reshape(prompts * kv_heads, group * per_kv, length)
    weights = torch.softmax(torch.cat([prompt_scores, own_scores], dim=-1), dim=-1)
    prompt_values = shared.prompt_values.view(prompts * kv_heads, prompt_length, dim)
    out = torch.bmm(weights[..., :prompt_length], prompt_values).view(prompts, kv_heads, group, per_kv, dim)
    own_weights = weights[..., prompt_length:].view(prompts, kv_heads, group, per_kv, length)
    out = out + torch.matmul(own_weights, own_values)
    return out.transpose(1, 2).reshape(batch, 1, heads, dim)


def native_decode(query, keys, values, valid, shared, scaling: float | None) -> torch.Tensor | None:
    """Return a decode step's attention from polo's native kernel, (batch, 1, heads, d), or None where it does not run.

    query (batch, heads, 1, d); keys, values (P, kv_heads, G, len, d), each row's own cached tokens
    (batch = P·G; a plain cache is G = 1); valid (batch, len) bool or None; `shared` the prompts held
    once per group (`polo.kernels.cpu.kv_cache.SharedPrompt`), in the same dtype, or None. It computes what
    `eager_attention` and `shared_prompt_decode` compute, with fp32 scores and weights (no bf16
    rounding between the products), reading the cache in place: for SmolLM2-135M's 64 rows over 70
    cached keys, 79 against 231 us a layer in bf16 (100 against 222 in fp32); 8 prompts x 8 rows over
    a 27-token prompt and 20 own tokens, 61 against 219 us (torch 2.13). None without
    the native library, off the CPU, with a gradient, in a dtype other than float32 / bfloat16, or with query,
    keys and values in different dtypes.
    """
    if torch.is_grad_enabled() or query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16):
        return None
    if keys.dtype != query.dtype or values.dtype != query.dtype:  # mixed (a LoRA layer's fp32 query under autocast)
        return None
    batch, heads, _, dim = query.shape
    if heads % keys.shape[1] or heads // keys.shape[1] > 16:
        return None
    ops = native_ops()
    if ops is None:
        return None
    scale = dim**-0.5 if scaling is None else scaling
    prompt = (None, None, None)
    if shared is not None:
        prompts, kv_heads, prompt_length = shared.prompt_keys.shape[:3]
        prompt = (shared.prompt_keys, shared.prompt_values, shared.prompt_bias.view(prompts, kv_heads, prompt_length))
    out = ops.decode_attention(query.reshape(batch, heads, dim), keys, values, valid, *prompt, scale)
    return out.view(batch, 1, heads, dim)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(POLO_ATTENTION, polo_attention)
    AttentionMaskInterface.register(POLO_ATTENTION, sdpa_mask)


def use_polo_attention(model: torch.nn.Module) -> bool:
    """Switch a model that uses transformers' "sdpa" attention to polo's; return whether it did.

    Models on any other attention implementation (eager, flash, flex, ...) are left alone.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    _register()
    model.set_attn_implementation(POLO_ATTENTION)
    return True
