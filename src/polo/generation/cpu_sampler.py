"""The CPU sampler: G completions per prompt with a preallocated KV cache, one prefill per prompt.

This is polo's first `Sampler` (see `polo.generation.rollouts`); rows that finish are dropped
from the batch and the cache, so no work is spent on finished sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polo.generation.prompts import stop_token_ids, tokenize_prompts
from polo.generation.rollouts import Rollouts
from polo.generation.sampling import sample_next_token
from polo.generation.stopping import StopStrings
from polo.kernels import contiguous_head_input, prepacked_linears, sampling_cache
from polo.models.family import cache_keyword
from polo.models.scoring import position_ids_from_mask
from polo.runtime.device import CPU, Compute


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: list[int],
    pad_id: int,
    compute: Compute = CPU,
    samples_per_prompt: int = 1,
    generator: torch.Generator | None = None,
    stop_strings: StopStrings | None = None,  # a turn's closing text (a tool call's tag) ends a row like EOS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return `(completion_ids, completion_mask, truncated)` sampled with a KV cache.

    Shapes: prompt (prompts, prompt_len) -> completion (batch, max_completion_len), truncated
    (batch,), with batch = prompts x `samples_per_prompt` and each prompt's samples in
    consecutive rows. Each prompt is run through the model once and its cache and next-token
    logits are repeated for its samples. Rows that have emitted a stop token are dropped from
    the batch and from the cache, so no work is spent on finished sequences. Every tensor lives on
    the prompts' device; the draws come from `generator` (the device's default one when None).
    """
    batch, device = prompt_ids.shape[0] * samples_per_prompt, prompt_ids.device
    completion_ids = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    completion_mask = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    truncated = torch.ones(batch, dtype=torch.bool, device=device)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    active_rows = torch.arange(batch, device=device)
    attention_mask = prompt_mask.long()
    positions = position_ids_from_mask(attention_mask)
    next_position = positions[:, -1] + 1
    cache = sampling_cache(model, prompt_ids.shape[1] + max_new_tokens)
    with_cache = {cache_keyword(model): cache}  # the name this transformers takes it under (polo.models.family)
    was_training = model.training
    model.eval()
    length = 0
    with compute.autocast(), contiguous_head_input(model), prepacked_linears(model, batch, compute):
        logits = model(
            input_ids=prompt_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            **with_cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        if samples_per_prompt > 1:  # one prefill per prompt; its samples part ways from the first draw
            cache.batch_repeat_interleave(samples_per_prompt)
            logits = logits.repeat_interleave(samples_per_prompt, dim=0)
            attention_mask = attention_mask.repeat_interleave(samples_per_prompt, dim=0)
            next_position = next_position.repeat_interleave(samples_per_prompt, dim=0)
        for step in range(max_new_tokens):
            tokens = sample_next_token(logits, temperature, top_p, generator)
            completion_ids[active_rows, step] = tokens
            completion_mask[active_rows, step] = 1
            length = step + 1
            finished = torch.isin(tokens, stop)
            if stop_strings is not None:
                finished |= stop_strings.reached(completion_ids[active_rows, : step + 1])
            truncated[active_rows[finished]] = False
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            if bool(finished.any()):
                keep = (~finished).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                active_rows, tokens = active_rows[keep], tokens[keep]
                attention_mask, next_position = attention_mask[keep], next_position[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active_rows), 1)], dim=1)
            logits = model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_position[:, None],
                **with_cache,
                use_cache=True,
            ).logits[:, -1]
            next_position = next_position + 1
    model.train(was_training)
    return completion_ids[:, :length], completion_mask[:, :length], truncated


def rollout(
    model,
    tokenizer,
    prompts: list[str],
    group_size: int,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    compute: Compute = CPU,
    generator: torch.Generator | None = None,
    rows: Sequence[dict] | None = None,
) -> Rollouts:
    """Return `group_size` sampled completions for each prompt, groups contiguous, on `compute.device`.

    `rows` (the task rows behind the prompts) are not read: a one-turn prompt is the whole context.
    """
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)
    prompt_ids, prompt_mask = prompt_ids.to(compute.device), prompt_mask.to(compute.device)
    completion_ids, completion_mask, truncated = generate(
        model,
        prompt_ids,
        prompt_mask,
        samples_per_prompt=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_ids=stop_token_ids(tokenizer, model),
        pad_id=tokenizer.pad_token_id,
        compute=compute,
        generator=generator,
    )
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    texts = tokenizer.batch_decode(
        completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id), skip_special_tokens=True
    )
    return Rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts, group_size)
