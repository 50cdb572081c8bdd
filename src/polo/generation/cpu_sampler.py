"""The CPU sampler: G completions per prompt with a preallocated KV cache, one prefill per prompt.

This is polo's first `Sampler` (see `polo.generation.rollouts`); rows that finish leave the batch
and the cache, a quarter of the batch at a time, so little work is spent on finished sequences.
Until then, with polo's attention, a prompt's G samples read its keys and values once per decode
step (`polo.kernels.share_prompt`), not once per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polo.generation.rollouts import Decoding, Rollouts, one_turn_rollouts
from polo.generation.sampling import Context, sample_next_token, token_logprobs
from polo.generation.stopping import Stopping
from polo.kernels import (
    contiguous_head_input,
    lean_decode_step,
    prepacked_linears,
    sampling_cache,
    share_prompt,
    shares_prompts,
)
from polo.models.family import cache_keyword
from polo.models.scoring import position_ids_from_mask
from polo.runtime.device import CPU, Compute

# Finished rows stay in the decode batch until this share of it has finished, then leave together.
# Dropping rows copies every layer's cache (about 6 ms for 64 rows of SmolLM2-135M, 8% of the demo's
# rollout when each finish dropped its rows at once), while a finished row costs only its small share
# of a decode step whose time goes to reading the weights.
COMPACT_SHARE = 0.25


class DecodeRows:
    """The completions being written and the decode batch's rows: which completion each writes, which are live.

    (batch, T) completion ids and mask, (batch,) truncated; `rows` and `live` are (present,) over the
    rows still in the decode batch (and its cache).
    """

    def __init__(self, batch: int, max_new_tokens: int, pad_id: int, device: torch.device, record: bool = False):
        self.completion_ids = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
        # each drawn token's log-prob under the sampler's own forward (Decoding.record_logprobs)
        self.logprobs = torch.zeros((batch, max_new_tokens), device=device) if record else None
        self.completion_mask = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
        self.truncated = torch.ones(batch, dtype=torch.bool, device=device)
        self.length, self.pad_id = 0, pad_id
        self.rows = torch.arange(batch, device=device)  # the completion row of each batch position
        self.live = torch.ones(batch, dtype=torch.bool, device=device)  # not finished yet
        self.prompts: Context | None = None  # each completion row's prompt, kept for the repetition penalty

    def keep_prompts(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples_per_prompt: int) -> None:
        """Keep each completion row's prompt (prompts, len), repeated for its samples, for `context`."""
        self.prompts = Context(
            prompt_ids.repeat_interleave(samples_per_prompt, dim=0),
            prompt_mask.repeat_interleave(samples_per_prompt, dim=0),
        )

    def context(self, index: torch.Tensor) -> Context | None:
        """Return the tokens the batch positions `index` (live,) have seen, their prompt and their completion so far;
        None unless `keep_prompts` kept the prompts."""
        if self.prompts is None:
            return None
        written = self.rows[index]
        return Context(
            torch.cat([self.prompts.ids[written], self.completion_ids[written, : self.length]], dim=1),
            torch.cat([self.prompts.mask[written], self.completion_mask[written, : self.length]], dim=1),
        )

    def live_index(self) -> torch.Tensor:
        """Return the batch positions still being written, (live,) long, in row order."""
        return self.live.nonzero().squeeze(1)

    def all_live(self) -> bool:
        """Return True when no row of the batch has finished."""
        return bool(self.live.all())

    def write(
        self,
        step: int,
        index: torch.Tensor,
        tokens: torch.Tensor,
        stop: torch.Tensor,
        logits: torch.Tensor,
        temperature,
    ) -> torch.Tensor:
        """Return which of `tokens` (one per live position `index`, drawn from `logits`) end their row, after writing
        them at `step` (and their log-probs, when recorded)."""
        written = self.rows[index]
        self.completion_ids[written, step] = tokens
        if self.logprobs is not None:
            self.logprobs[written, step] = token_logprobs(logits, tokens, temperature)
        self.completion_mask[written, step] = 1
        self.length = step + 1
        finished = torch.isin(tokens, stop)
        self.truncated[written[finished]] = False
        return finished

    def next_inputs(self, index: torch.Tensor, tokens: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
        """Return the next decode step's input token per batch position (finished rows decode padding: unread)."""
        inputs = (
            tokens if self.all_live() else tokens.new_full(self.live.shape, self.pad_id).index_put_((index,), tokens)
        )
        self.live[index[finished]] = False
        return inputs

    def compact(self) -> torch.Tensor | None:
        """Return the positions to keep (and keep only them) once `COMPACT_SHARE` of the batch finished, else None."""
        finished = int((~self.live).sum())
        if finished == 0 or finished < COMPACT_SHARE * self.live.shape[0]:
            return None
        keep = self.live.nonzero().squeeze(1)
        self.rows, self.live = self.rows[keep], self.live[keep]
        return keep

    def result(self) -> tuple[torch.Tensor, ...]:
        """Return `(completion_ids, completion_mask)` cut to the longest completion, and `truncated` (then the
        recorded log-probs, cut the same way)."""
        result = (self.completion_ids[:, : self.length], self.completion_mask[:, : self.length], self.truncated)
        return result if self.logprobs is None else (*result, self.logprobs[:, : self.length])


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    decoding: Decoding,
    stopping: Stopping,
    *,
    compute: Compute = CPU,
    samples_per_prompt: int = 1,
) -> tuple[torch.Tensor, ...]:
    """Return `(completion_ids, completion_mask, truncated)` sampled with a KV cache (and, with
    `decoding.record_logprobs`, each drawn token's log-prob `(batch, max_completion_len)`, 0 at padding).

    Shapes: prompt (prompts, prompt_len) -> completion (batch, max_completion_len), truncated
    (batch,), with batch = prompts x `samples_per_prompt` and each prompt's samples in
    consecutive rows. Each prompt is run through the model once and its next-token logits are
    repeated for its samples; so is its cache, except that a model on polo's attention reads one
    copy for the whole group until rows first leave the batch (`polo.kernels.share_prompt`). Rows
    that have emitted a stop token (or reached one of `stopping.strings`, a turn's closing text such
    as a tool call's tag) decode padding until `COMPACT_SHARE` of the batch has, then leave the
    batch and the cache together. Every tensor lives on
    the prompts' device; the draws come from `decoding.generator` (the device's default one when None).
    """
    # Read once: the decode loop below runs per token.
    max_new_tokens, stop_strings = decoding.max_new_tokens, stopping.strings
    batch, device = prompt_ids.shape[0] * samples_per_prompt, prompt_ids.device
    stop = torch.tensor(stopping.stop_ids, dtype=torch.long, device=device)
    attention_mask = prompt_mask.long()
    next_position = position_ids_from_mask(attention_mask)[:, -1] + 1
    cache = sampling_cache(model, prompt_ids.shape[1] + max_new_tokens)
    shared = samples_per_prompt > 1 and shares_prompts(model, cache)
    with_cache = {cache_keyword(model): cache}  # the name this transformers takes it under (polo.models.family)
    was_training = model.training
    model.eval()
    rows = DecodeRows(batch, max_new_tokens, stopping.pad_id, device, decoding.record_logprobs)
    if decoding.repetition_penalty != 1.0:  # the penalty reads each row's prompt and what it has written
        rows.keep_prompts(prompt_ids, attention_mask, samples_per_prompt)
    lean_step = lean_decode_step(model, cache, compute)
    with compute.autocast(), contiguous_head_input(model), prepacked_linears(model, batch, compute):
        logits, attention_mask = prefill(model, prompt_ids, attention_mask, cache)
        spread_prompts(cache, with_cache, attention_mask, samples_per_prompt, shared)
        if samples_per_prompt > 1:
            logits = logits.repeat_interleave(samples_per_prompt, dim=0)
            attention_mask = attention_mask.repeat_interleave(samples_per_prompt, dim=0)
            next_position = next_position.repeat_interleave(samples_per_prompt, dim=0)
        for step in range(max_new_tokens):
            index = rows.live_index()
            live_logits = logits if rows.all_live() else logits[index]
            tokens = sample_next_token(live_logits, decoding, rows.context(index))
            finished = rows.write(step, index, tokens, stop, live_logits, decoding.temperature)
            if stop_strings is not None:
                written = rows.rows[index]
                finished = finished | stop_strings.reached(rows.completion_ids[written, : step + 1])
                rows.truncated[written[finished]] = False
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            inputs = rows.next_inputs(index, tokens, finished)
            keep = rows.compact()
            if keep is not None:
                cache.batch_select_indices(keep)  # a shared cache turns back into plain rows here
                with_cache.pop("prompt_cache", None)
                shared = False
                inputs, attention_mask, next_position = inputs[keep], attention_mask[keep], next_position[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(inputs), 1)], dim=1)
            if lean_step is not None:  # the same logits without the forward's wrappers (polo.kernels.lean_decode_step)
                logits = lean_step(inputs, next_position, None if shared else attention_mask)
            else:
                logits = model(
                    input_ids=inputs[:, None],
                    attention_mask=None if shared else attention_mask,  # shared: the prompts' padding is in the cache
                    position_ids=next_position[:, None],
                    **with_cache,
                    use_cache=True,
                ).logits[:, -1]
            next_position = next_position + 1
    model.train(was_training)
    return rows.result()


# Prompts that start with at least this many common tokens (a system prompt, few-shot turns) run
# those tokens once: `prefill`.
MIN_COMMON_PREFIX = 16


def prefix_first(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return left-padded prompts laid out as [common prefix][padding][own tokens], (prompts, len) each.

    Every row's first `prefix` real tokens (the same in all rows) move to the front and its padding
    goes after them, so the prefix sits at the same positions in every row; position ids counted
    over the mask, and so the model's output, do not change.
    """
    columns = torch.arange(prompt_ids.shape[1], device=prompt_ids.device)[None]
    padding = (prompt_mask == 0).sum(-1, keepdim=True)
    source = torch.where(
        columns < prefix, columns + padding, torch.where(columns < prefix + padding, columns - prefix, columns)
    )
    return prompt_ids.gather(1, source), prompt_mask.gather(1, source)


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompts (prompts, len) into the cache; return the next-token logits (prompts, vocab) and the mask of
    the layout the cache now holds.

    Prompts that share a prefix of at least `MIN_COMMON_PREFIX` tokens, on a cache whose layers are
    all plain full attention, run it once (`prefix_first` layout, the one row's cache repeated for
    every prompt) and then only their own tokens. Held-out problems behind one system prompt and
    worked example (r1_zero_arith: 90 of 104 tokens) cost a tenth of the prefill.
    """
    from polo.kernels import can_share_prompt, common_prefix_length

    with_cache = {cache_keyword(model): cache, "use_cache": True, "logits_to_keep": 1}
    prefix = 0
    if prompt_ids.shape[0] > 1:  # each prompt keeps at least its last token to run itself (its next-token logits)
        prefix = min(common_prefix_length(prompt_ids, prompt_mask), int(prompt_mask.sum(-1).min()) - 1)
    if prefix < MIN_COMMON_PREFIX or not can_share_prompt(cache):
        prefix = 0
    else:
        prompt_ids, prompt_mask = prefix_first(prompt_ids, prompt_mask, prefix)
    positions = position_ids_from_mask(prompt_mask)
    if prefix:
        head = slice(0, 1), slice(0, prefix)
        model(input_ids=prompt_ids[head], attention_mask=prompt_mask[head], position_ids=positions[head], **with_cache)
        cache.batch_repeat_interleave(prompt_ids.shape[0])
    own = {"input_ids": prompt_ids[:, prefix:], "position_ids": positions[:, prefix:]}
    logits = model(**own, attention_mask=prompt_mask, **with_cache).logits[:, -1]
    return logits, prompt_mask


def spread_prompts(cache, with_cache: dict, prompt_mask: torch.Tensor, samples_per_prompt: int, shared: bool) -> None:
    """Make a cache prefilled with each prompt once serve its `samples_per_prompt` rows: held once and read per group
    (`shared`, the model's call then takes the cache as `prompt_cache` too) or repeated per row."""
    if shared:
        share_prompt(cache, prompt_mask, samples_per_prompt)
        with_cache["prompt_cache"] = cache
    elif samples_per_prompt > 1:  # one prefill per prompt; its samples part ways from the first draw
        cache.batch_repeat_interleave(samples_per_prompt)


def rollout(
    model,
    tokenizer,
    prompts: list[str],
    group_size: int,
    decoding: Decoding,
    *,
    compute: Compute = CPU,
    rows: Sequence[dict] | None = None,
) -> Rollouts:
    """Return `group_size` sampled completions for each prompt, groups contiguous, on `compute.device`.

    `rows` (the task rows behind the prompts) are not read: a one-turn prompt is the whole context.
    """
    return one_turn_rollouts(generate, model, tokenizer, prompts, group_size, decoding, compute)
