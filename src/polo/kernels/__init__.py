"""The kernels of a run, picked per device: the only importer of `polo.kernels.cpu`.

Everything above this layer asks for a kernel here, with the run's `Compute` (or the device of
its inputs), and never names a device itself:

    use_fast_attention(model, compute)     CPU: polo's attention (fp32 backward under bf16, block-wise
                                           shared prompts, GQA without copies); CUDA: transformers'
                                           SDPA, which torch dispatches to flash / memory-efficient kernels
    prepacked_linears(model, rows, compute)  CPU: oneDNN-prepacked bf16 linears (fp32 where measured faster)
    use_onednn_linears(model, compute)     CPU, fp32 runs: training linears (forward and both gradients) through
                                           oneDNN where it measured faster than torch's fp32 matmul
    contiguous_head_input(model)           any device: the LM head's input made contiguous
    use_lean_layers(model)                 any device: RMSNorms and SwiGLU MLPs that keep a fraction of their
                                           activations for backward (polo.kernels.lean), same outputs
    norm_outputs_recomputed()              any device: within, a lean norm's output kept for backward by the
                                           projections after it is recomputed from what the norm keeps
    sharing_pays(..., device)              CPU: the shared-prompt cost model; CUDA: plain rows
    share_prompts, attends_blockwise       the shared-prompt layout and whether attention skips its blocks
    without_padding                        the layout's real tokens as one row, for attention that skips blocks
    split_common_prefix                    rows of different prompts as one group sharing their prompts' common prefix
    common_prefix_length                   how many leading tokens left-padded prompts share (that split; prefill)
    supports_fused_logprobs, token_logprobs, completion_logprobs_fused, LogprobSettings
                                           chunked lm_head log-probs (polo.kernels.logprobs): plain torch
                                           on the inputs' device, never full fp32 logits on any device
    sampling_cache(model, capacity)        the preallocated KV cache of the CPU sampler
    lean_decode_step(model, cache, compute)  CPU: a decode step over that cache that calls the layers' parts
                                           directly (polo.kernels.cpu.decode), the forward's logits bit for bit;
                                           None for other models and devices
    shares_prompts, share_prompt           whether that cache can hold each prompt once for its group of
                                           samples (polo's attention reads it once a decode step), and doing so
    fast_path_fallbacks(model, compute)    the fast paths above that `model` does not take, and what it runs instead

Every choice changes speed only; the maths is the same on every path (tests/kernels).
"""

from __future__ import annotations

import contextlib

import torch

from polo.kernels.cpu import attention as _cpu_attention
from polo.kernels.cpu import linear as _cpu_linear
from polo.kernels.cpu import shared_prompt as _cpu_shared_prompt
from polo.kernels.cpu.decode import lean_decode_refusal, lean_decoder
from polo.kernels.cpu.kv_cache import can_share_prompt, sampling_cache, share_prompt
from polo.kernels.cpu.linear import contiguous_head_input, packed_fp32_pays
from polo.kernels.cpu.shared_prompt import (
    PrefixSplit,
    SharedPromptBatch,
    common_prefix_length,
    share_prompts,
    split_common_prefix,
    without_padding,
)
from polo.kernels.lean import kept_forwards, norm_outputs_recomputed, use_lean_layers
from polo.kernels.logprobs import (
    LogprobSettings,
    completion_logprobs_fused,
    supports_fused_logprobs,
    token_logprobs,
)
from polo.runtime.device import Compute
from polo.runtime.rates import cache_key

__all__ = [
    "LogprobSettings",
    "PrefixSplit",
    "SharedPromptBatch",
    "attends_blockwise",
    "completion_logprobs_fused",
    "norm_outputs_recomputed",
    "common_prefix_length",
    "contiguous_head_input",
    "fast_path_fallbacks",
    "lean_decode_step",
    "prepacked_linears",
    "sampling_cache",
    "share_prompt",
    "share_prompts",
    "shares_prompts",
    "sharing_pays",
    "split_common_prefix",
    "supports_fused_logprobs",
    "token_logprobs",
    "use_fast_attention",
    "use_lean_layers",
    "use_onednn_linears",
    "without_padding",
]

# Attention implementations that are transformers' SDPA underneath (torch picks flash or
# memory-efficient kernels for it on CUDA).
_SDPA_FAMILY = ("sdpa", _cpu_attention.POLO_ATTENTION)


def use_fast_attention(model: torch.nn.Module, compute: Compute) -> bool:
    """Return whether `model` attends through SDPA on `compute`'s device, switching it to polo's attention on the CPU.

    On the CPU a model on transformers' "sdpa" gets polo's attention (`polo.kernels.cpu.attention`).
    On CUDA "sdpa" is already the fast path (flash or memory-efficient attention through
    `scaled_dot_product_attention`), so the model keeps it. A model configured for another
    implementation (eager, flash_attention_2, flex, ...) is left as it is on every device.
    """
    if compute.device_type == "cpu":
        return _cpu_attention.use_polo_attention(model) or attends_blockwise(model)
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in _SDPA_FAMILY


def attends_blockwise(model: torch.nn.Module) -> bool:
    """Return whether `model`'s attention skips the all-masked blocks of the shared-prompt layout (polo's attention)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == _cpu_attention.POLO_ATTENTION


def prepacked_linears(model: torch.nn.Module, batch_hint: int, compute: Compute) -> contextlib.AbstractContextManager:
    """Return the context in which `model`'s linear layers multiply fastest for about `batch_hint` rows.

    On the CPU: bf16 weights packed once for oneDNN (`polo.kernels.cpu.linear.prepacked_linears`), and fp32
    ones where no autocast recasts them and this CPU's rates (`polo.runtime.rates`) measured oneDNN's packed
    fp32 matmul faster than torch's own. Elsewhere nothing: cuBLAS needs no repacking.
    """
    if compute.device_type == "cpu":
        fp32 = compute.precision == "fp32" and packed_fp32_pays(cache_key())
        return _cpu_linear.prepacked_linears(model, batch_hint, fp32=fp32)
    return contextlib.nullcontext()


def use_onednn_linears(model: torch.nn.Module, compute: Compute) -> int:
    """Route `model`'s fp32 linear layers through oneDNN for training and scoring (the KL reference's forward too);
    return how many were routed.

    On the CPU, in an fp32 run, where this CPU's rates (`polo.runtime.rates`) measured oneDNN's fp32
    matmul faster than torch's own (`packed_fp32_pays`; `polo.kernels.cpu.linear.OneDnnLinear`).
    Elsewhere nothing: bf16 matmuls already go through oneDNN, and cuBLAS is the fast path on a GPU.
    """
    if compute.device_type == "cpu" and compute.precision == "fp32" and packed_fp32_pays(cache_key()):
        return _cpu_linear.use_onednn_linears(model)
    return 0


def lean_decode_step(model: torch.nn.Module, cache, compute: Compute):
    """Return `step(tokens, positions, attention_mask) -> logits` decoding `model` over `cache` (`sampling_cache`)
    without its forward's wrappers, or None where only the forward decodes (`polo.kernels.cpu.decode.lean_decoder`).

    CPU only: on CUDA the static sampler captures the whole step instead.
    """
    if compute.device_type != "cpu":
        return None
    decoder = lean_decoder(model, cache)
    return None if decoder is None else decoder.step


def shares_prompts(model: torch.nn.Module, cache) -> bool:
    """Return whether sampling `model` with `cache` (`sampling_cache`) can hold each prompt once for its group of
    samples (`share_prompt`): polo's attention, which adds the prompt's part, and a cache whose every layer can."""
    return attends_blockwise(model) and can_share_prompt(cache)


def sharing_pays(
    prompt_len: int,
    completion_len: int,
    group_size: int,
    hidden_size: int,
    params_per_layer: float,
    *,
    blockwise: bool,
    device: torch.device,
) -> bool:
    """Return True when scoring a batch in the shared-prompt layout costs clearly less than plain rows on `device`.

    On the CPU, the cost model of `polo.kernels.cpu.shared_prompt.sharing_pays`. On other devices
    plain rows: the layout's (P + G·C)² boolean mask sends SDPA to its slow masked kernel, where
    plain causal rows get flash attention (block masks through flex_attention would be the way to share there).
    """
    if torch.device(device).type != "cpu":
        return False
    return _cpu_shared_prompt.sharing_pays(
        prompt_len, completion_len, group_size, hidden_size, params_per_layer, blockwise
    )


def fast_path_fallbacks(model: torch.nn.Module, compute: Compute) -> str:
    """Return the fast paths `model` (prepared: `use_fast_attention`, `use_lean_layers`) does not take on `compute`'s
    device and what runs instead, "; "-separated; "" where it takes them all. Every fallback computes the same maths.

    On the CPU: attention other than polo's (a model not on SDPA), the decode step through the model's forward
    (`polo.kernels.cpu.decode.lean_decode_refusal`); on any device: log-probs from the full logits where the head's
    output is post-processed (`supports_fused_logprobs`), norms and MLPs whose lean probe differed (`kept_forwards`).
    """
    notes = []
    if compute.device_type == "cpu":
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if implementation != _cpu_attention.POLO_ATTENTION:
            notes.append(f"attention: transformers' {implementation} (polo's takes models on sdpa)")
        refusal = lean_decode_refusal(model)
        if refusal is not None:
            notes.append(f"decode step through the model's forward ({refusal})")
    if not supports_fused_logprobs(model):
        notes.append("log-probs from the full logits (the head's output is post-processed)")
    kept = kept_forwards(model)
    if kept:
        notes.append(f"{kept} norms/MLPs on transformers' forward (not the lean ones' maths)")
    return "; ".join(notes)
