"""polo's attention: transformers' SDPA, plus fp32 compute for bf16 training on the CPU and block-wise shared prompts.

Registered with transformers as the attention implementation "polo_sdpa" (with SDPA's mask
builder), so a model switched to it by `use_polo_attention` gets the same masks and the same
maths as "sdpa", with two differences that only change speed:

- While a bf16 graph is recorded on the CPU, attention computes in fp32. The CPU's bf16
  flash-attention backward is slow: for 32 sequences x 148 tokens x 9 heads (SmolLM2-135M) it
  took 74 ms per layer against 26 ms in fp32, while the fp32 forward costs 3 ms more than bf16.
  Inference (no gradient: sampling, reference scoring) stays in bf16.
- Given `shared_layout` (polo.lm.shared_prompt, passed through the model's forward kwargs), it
  attends block by block and skips the blocks of the shared-prompt mask that are all False.
"""

from __future__ import annotations

import torch

__all__ = ["POLO_ATTENTION", "polo_attention", "use_polo_attention"]

POLO_ATTENTION = "polo_sdpa"


def polo_attention(module, query, key, value, attention_mask, *args, shared_layout=None, **kwargs):
    """transformers attention-interface function: (module, q, k, v, mask, ...) -> (output (batch, len, heads, d), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    upcast = torch.is_grad_enabled() and dtype == torch.bfloat16 and query.device.type == "cpu"

    def attend(q, k, v, mask):
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
            if mask is not None and mask.is_floating_point():
                mask = mask.float()
            with torch.autocast("cpu", enabled=False):
                return sdpa_attention_forward(module, q, k, v, mask, *args, **kwargs)[0].to(dtype)
        return sdpa_attention_forward(module, q, k, v, mask, *args, **kwargs)[0]

    if shared_layout is not None:
        from polo.lm.shared_prompt import shared_attention

        return shared_attention(attend, query, key, value, shared_layout), None
    return attend(query, key, value, attention_mask), None


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
