"""Log-probabilities of given completion tokens under a model: what the update, the reference
and the old policy all compute, on the [prompt | completion] layout of `polo.generation`.

Prompts are left-padded, completions right-padded, so the completion tokens are always the
last `completion_len` positions. Position ids count real tokens only, so a sequence gets the
same positions whether it was padded or not, in sampling and in training.
"""

from __future__ import annotations

import torch

from polo.kernels import (
    LogprobSettings,
    attends_blockwise,
    completion_logprobs_fused,
    contiguous_head_input,
    share_prompts,
    sharing_pays,
    split_common_prefix,
    supports_fused_logprobs,
    token_logprobs,
    without_padding,
)
from polo.models.family import fits_attention_window

# Score completions through the chunked lm_head path when the model allows it (see polo.kernels.logprobs).
FUSED_LOGPROBS = True


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Return position ids that count only real tokens, shape (batch, seq)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    group_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return per-token log-probs of the completion under `model`, (batch, completion_len).

    With `group_size` > 1 and rows in groups of identical prompts, each group's prompt is run
    once for all its completions when that saves compute on the inputs' device (polo.kernels.sharing_pays).
    Where attention reads the shared layout's blocks (polo's, on the CPU), the model runs the real
    tokens only, without the batch's padding (`shared_completion_logprobs`).

    log π(y_t | x, y_<t) = z[y_t]/T − logsumexp(z/T): taken with a gather and a logsumexp so
    no full-vocabulary log-softmax tensor is kept for backward. Logits are computed only for
    the completion positions. With `with_entropy`, also returns the per-token entropy of the
    sampling distribution: with a gradient on the chunked lm_head path (an entropy bonus trains
    through it), without one on the full-logits path.
    """
    if FUSED_LOGPROBS:
        shared = shared_completion_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            group_size,
            temperature=temperature,
            with_entropy=with_entropy,
        )
        if shared is not None:
            return shared
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    completion_len = completion_ids.shape[1]
    if FUSED_LOGPROBS and supports_fused_logprobs(model):
        # Chunks of the lm_head at a time: the full (batch, len, vocab) logits never exist.
        return completion_logprobs_fused(
            model,
            input_ids,
            attention_mask,
            position_ids_from_mask(attention_mask),
            completion_ids,
            LogprobSettings(temperature=temperature, with_entropy=with_entropy),
            completion_mask=completion_mask,
        )
    # The head gets a contiguous input: for a frozen lm_head (a reference, a LoRA base) matmul would
    # otherwise copy the whole (V, d) weight per row to multiply the strided slice of kept positions
    # (Gemma 3's 262k vocabulary: 34 s and ~10 GB per 32-row forward instead of under a second).
    with contiguous_head_input(model):
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            logits_to_keep=completion_len + 1,
        ).logits[:, :-1]
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    token_logits = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    logsumexp = torch.logsumexp(logits, dim=-1)
    logprobs = token_logits - logsumexp
    entropy = None
    if with_entropy:
        from polo.core import entropy_from_logits

        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach(), logsumexp.detach())
    return logprobs, entropy


def _params_per_layer(model) -> tuple[int, float]:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = int(config.hidden_size)
    intermediate = int(getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden)
    return hidden, 4.0 * hidden * hidden + 3.0 * hidden * intermediate  # attention + gated MLP, roughly


def shared_completion_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    group_size: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Return (log-probs, entropy or None), each (batch, C), scored in the shared layout; None when it does not apply.

    Applies when the model supports the chunked lm_head path (polo.kernels.logprobs), the batch is
    whole groups with identical prompts, `sharing_pays` on the inputs' device, and a row fits in
    every sliding attention window of the model (the shared layout's mask has no window; `polo.models.family`).
    With `group_size` 1 (every row its own group: SFT, or RL rows not worth sharing) the rows share
    their prompts' common prefix where that pays (`prefix_shared_logprobs`); else they run as their
    own groups only where attention reads the layout's blocks and the batch has padding to leave out.
    """
    if not supports_fused_logprobs(model):
        return None
    if not fits_attention_window(model, prompt_ids.shape[1] + completion_ids.shape[1]):
        return None
    blockwise = attends_blockwise(model)
    scoring = (completion_ids, completion_mask, LogprobSettings(temperature=temperature, with_entropy=with_entropy))
    if group_size == 1:
        prefixed = prefix_shared_logprobs(model, prompt_ids, prompt_mask, *scoring, blockwise=blockwise)
        if prefixed is not None:
            return prefixed
        if not blockwise or (bool(prompt_mask.all()) and bool(completion_mask.all())):
            return None
    elif not _sharing_pays(model, prompt_ids.shape[1], completion_ids.shape[1], group_size, blockwise, prompt_ids):
        return None
    shared = share_prompts(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size)
    if shared is None:
        return None
    return _score_shared(model, shared, shared.predictor_index, *scoring, blockwise=blockwise)


def prefix_shared_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    settings: LogprobSettings,
    *,
    blockwise: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Return (log-probs, entropy or None), each (batch, C), the common prefix of the prompts run once; None: no gain.

    Rows with different prompts that open alike (a system prompt, a worked example) become one
    group of the shared layout (`polo.kernels.split_common_prefix`): the prefix, then each row's
    remaining prompt tokens and its completion. Only the completion's positions go through the
    head. The values are those of the rows run one by one.
    """
    split = split_common_prefix(prompt_ids, prompt_mask, completion_ids, completion_mask)
    if split is None:
        return None
    batch, prefix, width = split.completion_ids.shape[0], split.prompt_ids.shape[1], split.completion_ids.shape[1]
    if not _sharing_pays(model, prefix, width, batch, blockwise, prompt_ids):
        return None
    shared = share_prompts(split.prompt_ids, split.prompt_mask, split.completion_ids, split.completion_mask, batch)
    if shared is None:
        return None
    # Completion token t of row i sits at position offset_i + t of the row's rest.
    columns = split.offset[:, None] + torch.arange(completion_ids.shape[1], device=completion_ids.device)[None]
    predictor_index = shared.predictor_index.gather(1, columns.clamp(max=width - 1))
    return _score_shared(model, shared, predictor_index, completion_ids, completion_mask, settings, blockwise=blockwise)


def _sharing_pays(model, prompt_len: int, completion_len: int, group_size: int, blockwise: bool, inputs) -> bool:
    """Return `polo.kernels.sharing_pays` for `model`'s sizes, on the device of `inputs`."""
    hidden_size, per_layer = _params_per_layer(model)
    return sharing_pays(
        prompt_len, completion_len, group_size, hidden_size, per_layer, blockwise=blockwise, device=inputs.device
    )


def _score_shared(
    model,
    shared,
    predictor_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: LogprobSettings,
    *,
    blockwise: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (log-probs, entropy or None) of `completion_ids`, each (batch, C), from the trunk run on `shared`.

    `predictor_index` (batch, C) is the flat position of the shared layout whose hidden state predicts each token.
    """
    if blockwise:  # the trunk runs real tokens only; attention gathers them into the blocks
        shared = without_padding(shared)
        predictor_index = shared.layout.token_index.reshape(-1)[predictor_index]  # padded -> real positions
    # polo's attention (polo.kernels.cpu.attention, picked by polo.kernels) reads `shared_layout` and skips the
    # all-masked blocks; any other attention implementation ignores it and applies the full mask.
    hidden = model.get_decoder()(
        input_ids=shared.input_ids,
        attention_mask=shared.attention_mask,
        position_ids=shared.position_ids,
        use_cache=False,
        shared_layout=shared.layout,
    ).last_hidden_state
    predictors = hidden.reshape(-1, hidden.shape[-1])[predictor_index]  # (batch, C, d)
    return token_logprobs(
        predictors,
        model.get_output_embeddings().weight,
        completion_ids,
        settings,
        mask=completion_mask,
    )
