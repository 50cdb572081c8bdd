"""The static-cache sampler: G completions per prompt, shapes fixed for the whole decode, so its step can be captured.

The same `Sampler` as `polo.generation.cpu_sampler` (one prefill per prompt, shared by its G
samples), laid out for a GPU:

- **Fixed shapes.** The decode batch is B = prompts x G rows and the cache holds L = P + T positions
  (P the left-padded prompt length, T = max_new_tokens) in every layer. Rows that finish are
  masked, not dropped: they keep decoding pad tokens that nothing reads, so every tensor keeps its
  shape and its address and one captured graph serves every step.
- **Sliding windows by the mask.** Sliding-window layers (Gemma 3) get a full-length cache like
  the others; transformers builds their mask from the model config, and a key is inside the
  window when q - k < window, which holds in cache indices as in positions (left padding shifts
  both). transformers' rolling window layer branches on a Python counter that changes every
  step, which would re-trace a captured step.
- **Sampling on the device** (`polo.generation.sampling.sample_on_device`), and the only host
  synchronisation is the check whether every row has finished, every `CHECK_EVERY` tokens.
- **Captured on CUDA.** The decode step's forward is compiled with `torch.compile(mode="reduce-overhead",
  fullgraph=True, dynamic=False)` (CUDA graphs) and the draw runs eagerly after it; on the CPU the
  step runs eager, which is how its logic is tested against the CPU sampler and `transformers.generate`.
  Prompts are left-padded to a multiple of `LENGTH_BUCKET` when captured, so a few graphs serve
  batches of any prompt length.
  A decoder (cache, buffers, compiled step) is kept per model and shape and reused by later calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from polo.generation.rollouts import Rollouts, one_turn_rollouts
from polo.generation.sampling import Context, Decoding, sample_on_device, token_logprobs
from polo.generation.stopping import Stopping, StopStrings
from polo.models.family import cache_keyword
from polo.models.scoring import position_ids_from_mask
from polo.runtime.device import CPU, Compute

CHECK_EVERY = 8  # tokens between two "has every row finished?" checks (the only host synchronisation)
LENGTH_BUCKET = 64  # captured decoders pad prompts to a multiple of this, so few shapes (graphs) are ever built
KEPT_DECODERS = 8  # decoders (cache + graph) kept per model, the least recently used dropped first
RECOMPILE_LIMIT = 256  # graphs of the decode step one process may build (one per decoder; Dynamo's default is 8)
# Dynamo's name for that limit: `recompile_limit` in recent torch (2.11, 2.13), `cache_size_limit` in older ones (2.6).
_RECOMPILE_LIMIT_NAME = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


@dataclass(frozen=True)
class DecodeShape:
    """What fixes a decoder's graph: batch rows, prompt and completion lengths, the sampling settings, capture."""

    batch: int
    prompt_len: int
    max_new_tokens: int
    decoding: Decoding  # without its generator, which each call gives
    stop_ids: tuple[int, ...]
    pad_id: int
    captured: bool

    @property
    def cache_len(self) -> int:
        """Return the positions the cache holds: the prompt and every completion token."""
        return self.prompt_len + self.max_new_tokens


def full_length_cache(model, cache_len: int, device: torch.device):
    """Return a transformers `StaticCache` for `model`, every layer (sliding ones too) `cache_len` long.

    Raise ValueError for a model with layers of another kind (linear attention, shared key/values),
    which this sampler does not lay out. transformers' layers make their position counters without a
    device: they are made on `device`.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    with torch.device(device):
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        layers = [
            StaticLayer(max_cache_len=cache_len) if isinstance(layer, StaticSlidingWindowLayer) else layer
            for layer in cache.layers
        ]
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not StaticLayer})
    if odd:
        raise ValueError(f"the static sampler lays out full and sliding-window attention only; this model has {odd}")
    for layer in layers:
        _values_in_their_own_dtype(layer)
    cache.layers = layers
    return cache


def _values_in_their_own_dtype(layer) -> None:
    """Make `layer` (a `StaticLayer`) allocate its values in the values' dtype, not the keys'.

    Under bf16 autocast the two differ: the projections give bf16, and the rotary embedding's fp32
    cos/sin promote the keys back to fp32. Some transformers releases (5.17, seen on an H200)
    allocate both in the keys' dtype, and the first value write then fails in `index_copy_`.
    """
    allocate = layer.lazy_initialization

    def lazy_initialization(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        allocate(key_states, value_states)
        if layer.values.dtype != value_states.dtype:
            layer.values = torch.zeros_like(layer.values, dtype=value_states.dtype)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(layer.values)  # written in place by a captured step

    layer.lazy_initialization = lazy_initialization


class StaticDecoder:
    """The fixed-address state of one decode shape (cache, token and mask buffers) and its decode step.

    `start` runs the prefill and the first draw for a batch of prompts; `step` decodes one token for
    every row (the captured part); `finish` reads the result. Reused across calls of the same shape.
    """

    def __init__(self, model, shape: DecodeShape, compute: Compute):
        device, rows = compute.device, shape.batch
        self.model, self.shape, self.compute = model, shape, compute
        self.cache = full_length_cache(model, shape.cache_len, device)
        self.cache_keyword = cache_keyword(model)  # "cache" or "past_key_values", by the transformers version
        self.tokens = torch.full((rows,), shape.pad_id, dtype=torch.long, device=device)  # each row's last token
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # the position of `tokens`
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # where the next drawn token is written
        self.completion_ids = torch.full((rows, shape.max_new_tokens), shape.pad_id, dtype=torch.long, device=device)
        self.completion_mask = torch.zeros((rows, shape.max_new_tokens), dtype=torch.long, device=device)
        self.logprobs = (
            torch.zeros((rows, shape.max_new_tokens), device=device) if shape.decoding.record_logprobs else None
        )
        # The whole decode attends through one (rows, L) mask: prompt padding 0, everything after 1;
        # causality (and any sliding window) hides the positions not yet written.
        self.attention_mask = torch.ones((rows, shape.cache_len), dtype=torch.long, device=device)
        self.stop = torch.tensor(shape.stop_ids, dtype=torch.long, device=device)
        self.decoding = shape.decoding  # the shape's, with each call's generator (`start`)
        self.prompts: Context | None = None  # each row's prompt, read by the repetition penalty (eager, as the draw)
        buffers = (self.tokens, self.positions, self.finished, self.column, self.completion_ids, self.completion_mask)
        for buffer in (*buffers, self.attention_mask):
            torch._dynamo.mark_static_address(buffer)  # mutated in place by the graph: CUDA graphs need fixed addresses
        self.forward = self._next_logits
        if shape.captured:
            mode = "reduce-overhead" if compute.is_cuda else None
            compiled = torch.compile(self._next_logits, fullgraph=True, dynamic=False, mode=mode)

            def forward() -> torch.Tensor:
                # Every decoder compiles the same method once (its own graph: `self` differs), so the default
                # limit of 8 recompiles per code object would fail a process that has made more decoders than that.
                with torch._dynamo.config.patch(**{_RECOMPILE_LIMIT_NAME: RECOMPILE_LIMIT}):
                    return compiled()

            self.forward = forward

    @torch.no_grad()
    def start(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        group_size: int,
        generator: torch.Generator | None,
    ) -> None:
        """Return nothing: prefill each prompt (prompts, P) once, copy it to its G rows, draw the first tokens."""
        prompts, prompt_len = prompt_ids.shape
        positions = position_ids_from_mask(prompt_mask.long())
        prefill_cache = full_length_cache(self.model, prompt_len, self.compute.device)
        logits = self.model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions,
            **{cache_keyword(self.model): prefill_cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        for layer, prefilled in zip(self.cache.layers, prefill_cache.layers):
            if not layer.is_initialized:  # allocated once, at the decode batch's size
                rows = (self.shape.batch, -1, -1, -1)
                layer.lazy_initialization(prefilled.keys[:1].expand(rows), prefilled.values[:1].expand(rows))
            layer.keys.unflatten(0, (prompts, group_size))[:, :, :, :prompt_len].copy_(prefilled.keys.unsqueeze(1))
            layer.values.unflatten(0, (prompts, group_size))[:, :, :, :prompt_len].copy_(prefilled.values.unsqueeze(1))
            layer.cumulative_length.fill_(prompt_len)
        self.attention_mask[:, :prompt_len].copy_(prompt_mask.repeat_interleave(group_size, dim=0))
        self.positions.copy_((positions[:, -1] + 1).repeat_interleave(group_size, dim=0))
        self.finished.zero_()
        self.column.zero_()
        self.completion_ids.fill_(self.shape.pad_id)
        self.completion_mask.zero_()
        self.decoding = replace(self.shape.decoding, generator=generator)
        if self.shape.decoding.repetition_penalty != 1.0:
            self.prompts = Context(
                prompt_ids.repeat_interleave(group_size, dim=0), prompt_mask.repeat_interleave(group_size, dim=0)
            )
        if self.logprobs is not None:
            self.logprobs.zero_()
        self._take(logits.repeat_interleave(group_size, dim=0))

    def step(self) -> None:
        """Return nothing: run the model on each row's last token, draw the next (fixed shapes, in place, no sync).

        Only the model's forward is captured; the draw runs eagerly after it, a handful of kernels
        with no host read. Inductor (torch 2.11, on an H200) failed to generate the vocabulary-wide
        cumulative sum that the draw needs, and eager sampling also draws from `decoding.generator`.
        """
        self._take(self.forward())

    def _next_logits(self) -> torch.Tensor:
        """Return each row's next-token logits (rows, vocab), the cache written at `positions`, which advance by 1."""
        logits = self.model(
            input_ids=self.tokens[:, None],
            attention_mask=self.attention_mask,
            position_ids=self.positions[:, None],
            use_cache=True,
            **{self.cache_keyword: self.cache},
        ).logits[:, -1]
        self.positions.add_(1)
        return logits

    def _take(self, logits: torch.Tensor) -> None:
        """Return nothing: draw a token per row from `logits` (rows, vocab); finished rows write pad, masked."""
        context = None
        if self.prompts is not None:  # unwritten columns and finished rows are masked out, so the shapes stay fixed
            context = Context(
                torch.cat([self.prompts.ids, self.completion_ids], dim=1),
                torch.cat([self.prompts.mask, self.completion_mask], dim=1),
            )
        drawn = sample_on_device(logits, self.decoding, context)
        tokens = drawn.masked_fill(self.finished, self.shape.pad_id)
        self.completion_ids.index_copy_(1, self.column, tokens[:, None])
        self.completion_mask.index_copy_(1, self.column, (~self.finished).long()[:, None])
        if self.logprobs is not None:  # eager, after the captured forward, like the draw
            drawn_logprobs = token_logprobs(logits, drawn, self.decoding.temperature).masked_fill(self.finished, 0.0)
            self.logprobs.index_copy_(1, self.column, drawn_logprobs[:, None])
        self.finished.logical_or_(torch.isin(tokens, self.stop))
        self.tokens.copy_(tokens)
        self.column.add_(1)

    @torch.no_grad()
    def decode(self, stop_strings: StopStrings | None = None) -> None:
        """Return nothing: decode until every row has finished (checked every `CHECK_EVERY` tokens) or T are drawn.

        `stop_strings` are looked for on the host at those checks (a row may run a few tokens past
        one; the episode sampler cuts each turn at its first stop string).
        """
        for step in range(1, self.shape.max_new_tokens):
            if step % CHECK_EVERY == 0:
                if stop_strings is not None:
                    reached = stop_strings.reached(self.completion_ids[:, :step], new_tokens=CHECK_EVERY)
                    self.finished.logical_or_(reached.to(self.finished.device))
                if bool(self.finished.all()):
                    break
            self.step()

    def finish(self) -> tuple[torch.Tensor, ...]:
        """Return copies of `(completion_ids, completion_mask, truncated)`: (rows, longest) twice, then (rows,); and
        the recorded log-probs (rows, longest) when the shape records them."""
        length = int(self.completion_mask.sum(-1).max()) if self.shape.batch else 0
        result = (self.completion_ids[:, :length].clone(), self.completion_mask[:, :length].clone(), ~self.finished)
        return result if self.logprobs is None else (*result, self.logprobs[:, :length].clone())


def decoder_for(model, shape: DecodeShape, compute: Compute) -> StaticDecoder:
    """Return the model's decoder of `shape`, built on first use; the least recently used beyond `KEPT_DECODERS` go.

    Kept on the model itself, so they live and die with it (a captured graph is tied to its weights).
    """
    decoders = model.__dict__.setdefault("_polo_static_decoders", OrderedDict())
    key = (shape, compute)
    if key not in decoders:
        decoders[key] = StaticDecoder(model, shape, compute)
        while len(decoders) > KEPT_DECODERS:
            decoders.popitem(last=False)
    decoders.move_to_end(key)
    return decoders[key]


def left_pad(ids: torch.Tensor, mask: torch.Tensor, length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(ids, mask)` (rows, seq) left-padded to (rows, `length`) with `pad_id` and mask 0."""
    extra = length - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return torch.nn.functional.pad(ids, (extra, 0), value=pad_id), torch.nn.functional.pad(mask, (extra, 0), value=0)


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
    capture: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """Return `(completion_ids, completion_mask, truncated)` as `cpu_sampler.generate` does, with fixed shapes (and
    the drawn tokens' log-probs with `decoding.record_logprobs`).

    Shapes: prompt (prompts, prompt_len) -> completion (batch, longest completion), truncated (batch,),
    batch = prompts x `samples_per_prompt`, a prompt's samples in consecutive rows. `capture` (default:
    on CUDA) compiles the decode step's forward; the draws come from `decoding.generator` either way.
    """
    if decoding.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {decoding.max_new_tokens}")
    capture = compute.is_cuda if capture is None else capture
    if capture:
        bucket = -(-prompt_ids.shape[1] // LENGTH_BUCKET) * LENGTH_BUCKET
        prompt_ids, prompt_mask = left_pad(prompt_ids, prompt_mask, bucket, stopping.pad_id)
    shape = DecodeShape(
        prompt_ids.shape[0] * samples_per_prompt,
        prompt_ids.shape[1],
        decoding.max_new_tokens,
        replace(decoding, generator=None, temperature=float(decoding.temperature), top_p=float(decoding.top_p)),
        stopping.stop_ids,
        stopping.pad_id,
        capture,
    )
    decoder = decoder_for(model, shape, compute)
    was_training = model.training
    model.eval()
    try:
        with compute.autocast():
            decoder.start(prompt_ids, prompt_mask, samples_per_prompt, decoding.generator)
            decoder.decode(stopping.strings)
    finally:
        model.train(was_training)
    return decoder.finish()


def rollout(
    model,
    tokenizer,
    prompts: list[str],
    group_size: int,
    decoding: Decoding,
    *,
    compute: Compute = CPU,
    capture: bool | None = None,
    rows: Sequence[dict] | None = None,
) -> Rollouts:
    """Return `group_size` sampled completions for each prompt, groups contiguous, on `compute.device` (a `Sampler`).

    `rows` (the task rows behind the prompts) are not read: a one-turn prompt is the whole context.
    """
    return one_turn_rollouts(generate, model, tokenizer, prompts, group_size, decoding, compute, capture=capture)
