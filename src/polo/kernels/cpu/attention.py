"""polo's attention: transformers' SDPA, plus fp32 compute for bf16 training on the CPU and block-wise shared prompts.

Registered with transformers as the attention implementation "polo_sdpa" (with SDPA's mask
builder), so a model switched to it by `use_polo_attention` gets the same masks and the same
maths as "sdpa", with two differences that only change speed:

- While a bf16 graph is recorded on the CPU, attention computes in fp32. The CPU's bf16
  flash-attention backward is slow: for 32 sequences x 148 tokens x 9 heads (SmolLM2-135M) it
  took 74 ms per layer against 26 ms in fp32, while the fp32 forward costs 3 ms more than bf16.
  Inference (no gradient: sampling, reference scoring) stays in bf16.
- Given `shared_layout` (polo.kernels.cpu.shared_prompt, passed through the model's forward kwargs), it
  attends block by block and skips the blocks of the shared-prompt mask that are all False.
- With grouped-query attention (fewer key/value heads than query heads) and a boolean mask on
  the CPU, it asks SDPA for GQA (`enable_gqa`) instead of copying every key/value head G times
  as transformers does whenever a mask is given. For SmolLM2-135M (9 query, 3 key/value heads)
  in the shared layout, forward + backward of one layer went from 33 to 16 ms; the copies and
  their zero-filled gradients had cost ~1.9 s of a 17 s profiled GRPO step.
"""

from __future__ import annotations

import torch

from polo.kernels.cpu import shared_prompt

__all__ = ["POLO_ATTENTION", "polo_attention", "use_polo_attention"]

POLO_ATTENTION = "polo_sdpa"


def polo_attention(module, query, key, value, attention_mask, *args, shared_layout=None, **kwargs):
    """Return (output (batch, len, heads, d), None): transformers' attention interface, (module, q, k, v, mask, ...)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    upcast = torch.is_grad_enabled() and dtype == torch.bfloat16 and query.device.type == "cpu"

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
# sdpa_attention_forward does (the mask already carries causality, padding and any sliding window).
_PLAIN_KWARGS = {
    "dropout",
    "scaling",
    "is_causal",
    "position_ids",
    "sliding_window",
    "output_attentions",
    "use_cache",
    "cache_position",
}


def gqa_without_copies(module, query: torch.Tensor, key: torch.Tensor, mask, args: tuple, kwargs: dict) -> bool:
    """Return whether this attention call can go to SDPA with `enable_gqa` (as if the key/value heads were repeated).

    Only for a plain call: CPU, a boolean mask (so transformers would not use is_causal), more query
    than key/value heads, and no extra terms (softcapping, position bias, attention sinks, ...).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    return (
        query.device.type == "cpu"
        and groups > 1
        and query.dim() == 4
        and key.dim() == 4
        and query.shape[-3] == key.shape[-3] * groups
        and query.shape[-2] > 1  # one query token: transformers already folds the heads without copies
        and isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and not args
        and all(name in _PLAIN_KWARGS or value is None for name, value in kwargs.items())
    )


def one_query_over_groups(module, query: torch.Tensor, key: torch.Tensor, mask, args: tuple, kwargs: dict) -> bool:
    """Return whether this is a decode step (one query token) of grouped-query attention for `decode_attention`.

    Only for a plain call on the CPU with a mask shared by every head (or none), and no extra terms.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    return (
        query.device.type == "cpu"
        and groups > 1
        and query.dim() == 4
        and key.dim() == 4
        and query.shape[-2] == 1
        and query.shape[-3] == key.shape[-3] * groups
        and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 1))
        and not args
        and all(name in _PLAIN_KWARGS or value is None for name, value in kwargs.items())
    )


def decode_attention(query, key, value, mask, scaling: float | None) -> torch.Tensor:
    """Return attention for one query token per row, (batch, 1, heads, d), each key/value head's queries as its rows.

    query (batch, heads, 1, d); key, value (batch, kv_heads, len, d); mask None or (batch, 1, 1, len).
    The G query heads that share a key/value head become G query rows of that head, so SDPA runs
    on (batch, kv_heads, G, d) without repeating keys and values. transformers does this only when
    a mask is given; without one it asks SDPA for `enable_gqa`, whose CPU kernel took 1.9 ms per
    layer for 32 rows x 130 cached tokens of SmolLM2-135M against 0.38 ms this way (torch 2.13,
    2-core EPYC): over half of a 64-token rollout.
    """
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    packed = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, heads, head_dim)


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
