"""Tiny random decoders of the families people train with RL, built in memory from transformers' own config classes.

No download, random weights, fp32: 2 layers, hidden 32, 4 query heads over 2 key/value heads, over the
character tokenizer of `char_tokenizer` (its ids 0-2 are <unk>, <|im_start|>, <|im_end|>: EOS and padding).

Why these families: they are the open-weight models RL recipes start from. Llama (Llama 3.x, SmolLM2,
the R1 distills of Llama), Qwen2 (Qwen2.5 and Qwen2.5-Math, the base of most R1-style reproductions and of
DeepSeek-R1-Distill-Qwen), Qwen3 (q/k norms) and Qwen3-MoE (Qwen3-30B-A3B), Mixtral (the first open
mixture of experts), Mistral, Phi-3 / Phi-4-mini (fused q/k/v and gate/up projections), Gemma 2 (soft-capped
attention and logits) and Gemma 3 (sliding windows, 1 + w norms), OLMo 2 (fully open, post-norm layers, RLVR's
Tülu 3 recipe), Granite (embedding, residual, attention and logit multipliers) and SmolLM3 (layers without
rotary embedding). Between them they cover every layer variant a transformers decoder of this kind has:
q/k norms, post-norms, soft-capping, sliding windows, NoPE layers, fused projections, multipliers, experts.
Each gets sizes that make its variant matter (a window shorter than the sequences, non-unit multipliers).
"""

from __future__ import annotations

import torch

from conftest import char_tokenizer

EOS = PAD = 2
WINDOW = 6  # the sliding window of the windowed families: shorter than prompt + completion

COMMON = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": None,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    # Larger than transformers' 0.02: the logits of a random model then differ by more than rounding, so greedy
    # tokens are decided by the model and not by the summation order of one kernel or another.
    "initializer_range": 0.3,
}

# family -> (config class name, model class name, the sizes that make its variant matter)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8, "tie_word_embeddings": True}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW, "final_logit_softcapping": 5.0},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW, "layer_types": None},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {"embedding_multiplier": 2.0, "logits_scaling": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3},
    ),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
}

MOE_FAMILIES = ("qwen3_moe", "mixtral")


def tiny_family(family: str, vocab_size: int, seed: int = 0, **config) -> torch.nn.Module:
    """Return a random fp32 causal LM of `family` (`FAMILIES`) over `vocab_size` ids, in eval mode, on the CPU."""
    import transformers

    config_class, model_class, sizes = FAMILIES[family]
    settings = {**COMMON, **sizes, "vocab_size": vocab_size, **config}
    if family == "gemma3":
        settings["layer_types"] = ["sliding_attention", "full_attention"]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**settings))
    return model.float().eval()


def save_family(family: str, directory, **config):
    """Write a tiny `family` model and `char_tokenizer` to `directory` (loadable by `polo train`); return it."""
    tokenizer = char_tokenizer("left")
    model = tiny_family(family, len(tokenizer), **config)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory
