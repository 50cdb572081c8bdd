"""A sampling decode step for Llama-like decoders on the CPU that calls each layer's parts directly.

A decode step through transformers' modules (`model(input_ids=..., cache=...)`) runs the same
kernels as this one, but around them it builds the attention mask, passes through the output-capturing
and deprecation wrappers of the model and every layer, and dispatches each part through
`nn.Module.__call__`. `LeanDecoder.step` keeps the kernels (the model's own norm, MLP and linear
forwards, packed by `prepacked_linears`; polo's decode attention) and drops the rest; where polo's
native kernels run, the rotary embedding of the queries and of the keys is one call each (`rotary`,
decode_step.cpp) instead of five ops, and each residual add is fused into the norm after it (`add_rms_norm`).

Measured on the bench's step-1 prompts (32 rows, 8 per prompt, SmolLM2-135M in bf16, on a CPU
with bf16 at ~400 GFLOP/s), four alternating rounds of 60 steps: 50.0-55.4 ms a step through
the forward, 45.3-52.3 ms here. Most of a step is kernels: the linears alone take ~28-31 ms at 32
rows (~300 GFLOP/s), attention ~4 ms; without the rotary embedding and the residual adds the step
took ~4 ms less, so fusing those is worth at most that.

The logits are the forward's bit for bit (tests/kernels/test_decode.py compares them over plain,
shared-prompt and compacted caches, for both model families and both dtypes). Only decoders whose
parts are known are taken (`lean_decoder`); any other model decodes through its forward.

Why by hand: no library offers a CPU decode step over a preallocated, prompt-sharing cache; the
engines that have fast decode loops (vLLM's CPU backend) replace the model implementation and the
sampler altogether.
"""

from __future__ import annotations

import torch

from polo.kernels import lean as _lean
from polo.kernels.cpu import attention as _attention

__all__ = ["LeanDecoder", "lean_decoder"]

# model_type -> the decoder families whose layers are exactly [norm, attention (q/k/v/o projections with
# rotary embedding), residual, norm, MLP, residual], with nothing else between them (no q/k norms, no
# soft-capping, no scaled embeddings): the layout `LeanDecoder.step` computes.
LEAN_FAMILIES = ("llama", "qwen2")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def lean_decoder(model, cache) -> LeanDecoder | None:
    """Return a `LeanDecoder` for `model` sampling with `cache` (`polo.kernels.cpu.kv_cache.sampling_cache`), or None.

    None unless the model is a causal LM of a family in `LEAN_FAMILIES` on polo's attention, every
    layer has the expected parts and full attention, and every layer of the cache is a preallocated one.
    """
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in LEAN_FAMILIES:
        return None
    if (
        getattr(config, "_attn_implementation", None) != _attention.POLO_ATTENTION
        or getattr(model, "lm_head", None) is None
    ):
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    layers = getattr(inner, "layers", None)
    if (
        layers is None
        or len(layers) != len(cache.layers)
        or not all(hasattr(layer, "shared") for layer in cache.layers)
    ):
        return None
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if not all(hasattr(layer, name) for name in _LAYER_PARTS) or not all(
            hasattr(attention, name) for name in _ATTENTION_PARTS
        ):
            return None
        if hasattr(attention, "q_norm") or getattr(attention, "sliding_window", None):
            return None
    if not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm")):
        return None
    return LeanDecoder(model, cache)


class LeanDecoder:
    """One model's decode step over one sampling cache (see the module's docstring)."""

    def __init__(self, model, cache):
        self.model, self.cache, self.inner = model, cache, model.model
        attention = self.inner.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Return the next-token logits (rows, vocab) after `tokens` (rows,) at `positions` (rows,), cached as it goes.

        attention_mask (rows, cached + 1) long, 1 where a row may attend (its prompt's padding is 0),
        for a cache of plain rows; None while the cache holds shared prompts (their padding is in it).
        """
        rows, dim = tokens.shape[0], self.head_dim
        inner = self.inner
        hidden = torch.nn.functional.embedding(tokens, inner.embed_tokens.weight)
        cos, sin = inner.rotary_emb(hidden, positions[:, None])  # (rows, 1, d) each, in the hidden states' dtype
        cos, sin = cos.view(rows, 1, dim), sin.view(rows, 1, dim)
        valid = None if attention_mask is None else attention_mask.bool()
        residual = None
        for layer, cache_layer in zip(inner.layers, self.cache.layers, strict=True):
            attention = layer.self_attn
            hidden, residual = self._norm(layer.input_layernorm, hidden, residual)
            query = attention.q_proj.forward(hidden).view(rows, self.heads, dim)
            key = attention.k_proj.forward(hidden).view(rows, self.kv_heads, dim)
            value = attention.v_proj.forward(hidden).view(rows, self.kv_heads, dim)
            query, key = rotate(query, cos, sin), rotate(key, cos, sin)
            keys, values = cache_layer.update(key[:, :, None], value[:, :, None])
            out = self._attend(attention, query[:, :, None], keys, values, valid, cache_layer.shared)
            hidden = attention.o_proj.forward(out.view(rows, self.heads * dim))
            hidden, residual = self._norm(layer.post_attention_layernorm, hidden, residual)
            hidden = layer.mlp.forward(hidden)
        hidden, _ = self._norm(inner.norm, hidden, residual)
        return self.model.lm_head.forward(hidden)

    @staticmethod
    def _norm(norm, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(residual + hidden), residual + hidden): a decoder layer's residual add and the norm after it.

        One native call (`add_rms_norm`) for a lean norm (`polo.kernels.lean`) over a residual stream in one dtype,
        where the native kernels run; else the add, then the norm's own forward.
        """
        if residual is None:
            return norm.forward(hidden), hidden
        if getattr(norm, "_polo_lean", False) and hidden.dtype == residual.dtype:
            ops = _lean._native_norm(hidden, norm.weight)
            if ops is not None:
                return ops.add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
        hidden = residual + hidden
        return norm.forward(hidden), hidden

    @staticmethod
    def _attend(attention, query, keys, values, valid, shared) -> torch.Tensor:
        """Return polo's decode attention (rows, 1, heads, d), as `polo_attention` computes it for this step."""
        scaling = attention.scaling  # the functions are looked up in their module each step: one place to change them
        if shared is not None:
            native = _attention.native_decode(query, keys, values, None, shared, scaling)
            return _attention.shared_prompt_decode(query, keys, values, shared, scaling) if native is None else native
        mask = None if valid is None else valid[:, None, None, :]
        return _attention.eager_or_native(query, keys, values, mask, scaling)


def rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return states·cos + rotate_half(states)·sin, (rows, heads, d): the rotary embedding, as transformers applies it.

    states (rows, heads, d); cos, sin (rows, 1, d). rotate_half(x) = [-x₂, x₁] for the two halves of d.
    One native call (`rotary`, the same roundings) where the native kernels run and the three share a dtype.
    """
    if states.dtype == cos.dtype == sin.dtype:
        ops = _lean._native(states, cos, sin)
        if ops is not None:
            return ops.rotary(states, cos, sin)
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin
