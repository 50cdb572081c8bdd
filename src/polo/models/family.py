"""What differs between model families, decided in one place from what a tokenizer or model does, never from its name.

- **BOS.** A tokenizer that puts special tokens in front of every text (Gemma's `<bos>`, Llama's
  `<|begin_of_text|>`) was trained on texts that start with them: without its BOS Gemma 3 270M
  writes junk. polo tokenizes prompts without special tokens (so no EOS is ever appended) and
  prepends exactly what the tokenizer itself would put in front (`prompt_prefix_ids`), unless the
  text already starts with it: a chat template that writes `{{ bos_token }}` gets no second BOS.
  Tokenizers that add nothing (SmolLM2) are left exactly as they were. `encode_prompts` is the one
  way prompts become token ids: in sampling, scoring, evaluation, SFT, DPO, reward models and
  preference data alike.
- **Chat template.** Base models have none; `polo.generation.prompts.format_prompt` then writes the
  instruction as plain text (a completion-style prompt such as "Q: 12+34=\\nA:").
- **Attention kind.** Sliding-window layers (Gemma 3: five of every six layers see only the last 512
  positions) are honoured wherever transformers builds the mask or the cache: sampling, plain
  scoring, and the cached shared-prompt pass of SFT/DPO/reward models. The one exception is polo's
  shared-prompt scoring layout (`polo.kernels.cpu.shared_prompt`), whose hand-built mask has no
  window: `fits_attention_window` keeps a batch out of it when a row is longer than the window.
- **The cache keyword.** transformers 5.24 takes a KV cache as `cache=` and warns that
  `past_key_values=` goes away in 5.40; 5.17 (the GPU machine's) knows only `past_key_values=` and
  would silently ignore `cache=`. `cache_keyword` reads the model's own forward signature, so the
  samplers pass their cache under the name this model takes.
- **Output head, embeddings, attention scaling.** Tied embeddings, Gemma's √hidden embedding scale,
  its `query_pre_attn_scalar` (passed to attention as `scaling`) all live inside the model's own
  modules, which polo runs as they are. Whether log-probs may take the chunked lm_head path is decided
  by tracing the model (`polo.kernels.logprobs.supports_fused_logprobs`): a trunk ending in its
  final norm, then a bias-free linear head, nothing after it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

_PROBE_TEXT = "a"


def cache_keyword(model: Any) -> str:
    """Return the keyword `model`'s forward takes its KV cache under: "cache" (transformers >= 5.24) or
    "past_key_values"."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model passes kwargs through
    parameters = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def prompt_prefix_ids(tokenizer: Any) -> tuple[int, ...]:
    """Return the token ids `tokenizer` puts in front of a text when it adds special tokens (its BOS), () when none.

    Found by encoding a probe text with and without special tokens, so it follows the tokenizer's
    own post-processor (Gemma's tokenizer adds `<bos>` there while `add_bos_token` reads False).
    Only leading tokens count: a prompt never gets an appended EOS.
    """
    plain = list(tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(_PROBE_TEXT, add_special_tokens=True)["input_ids"])
    if not plain:
        return ()
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(full[:start])
    bos = getattr(tokenizer, "bos_token_id", None)
    return (bos,) if bos is not None and full[:1] == [bos] and plain[:1] != [bos] else ()


def encode_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Return each already-formatted prompt text as token ids, with the tokenizer's BOS in front exactly once.

    Texts are tokenized without special tokens; `prompt_prefix_ids(tokenizer)` is prepended to each
    row that does not already start with it (a chat template may have written it).
    """
    if not texts:
        return []
    prefix = list(prompt_prefix_ids(tokenizer))
    rows = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    if not prefix:
        return [list(row) for row in rows]
    return [list(row) if list(row[: len(prefix)]) == prefix else prefix + list(row) for row in rows]


def context_length(model: Any) -> int | None:
    """Return the most positions `model` was built for (its config's ``max_position_embeddings``, GPT-2's
    ``n_positions``), None when its config names none."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def attention_window(model: Any) -> int | None:
    """Return the smallest sliding attention window of `model`'s attention layers, None when all see every position.

    Read from the layers themselves (transformers' attention modules carry `sliding_window`, None on
    full-attention layers), so it holds for any family that has such layers.
    """
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    windows = [
        window
        for module in modules
        if isinstance(window := getattr(module, "sliding_window", None), int) and window > 0
    ]
    return min(windows) if windows else None


def fits_attention_window(model: Any, length: int) -> bool:
    """Return whether a sequence of `length` positions is short enough that no sliding window of `model` cuts into it.

    Then attention over it is the same with or without the window, and a mask that leaves the window
    out (polo's shared-prompt layout) gives the model's exact values.
    """
    window = attention_window(model)
    return window is None or length <= window
