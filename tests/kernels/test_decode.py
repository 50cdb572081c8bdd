"""polo.kernels.cpu.decode: the lean decode step gives the model forward's logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from polo.generation import cpu_sampler
from polo.generation.rollouts import Decoding
from polo.generation.stopping import Stopping
from polo.kernels import lean_decode_step, prepacked_linears, sampling_cache, use_fast_attention, use_lean_layers
from polo.kernels.cpu.decode import lean_decoder
from polo.models.family import cache_keyword
from polo.models.scoring import position_ids_from_mask
from polo.runtime.device import CPU, Compute


def biased_qwen2():
    """Return `tiny_qwen2` with random q/k/v biases, so that a step that dropped them would differ."""
    model = tiny_qwen2()
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
    return model


def prepared(model, dtype: torch.dtype):
    """Return `model` in `dtype` on polo's attention with lean layers, as the trainer samples it."""
    model = model.to(dtype).eval()
    assert use_fast_attention(model, CPU)
    use_lean_layers(model)
    return model


def prompts(prompts_count: int = 3, length: int = 9, seed: int = 1):
    """Return left-padded prompt ids and mask (prompts, length), the rows of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 97, (prompts_count, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(prompts_count):
        mask[row, : row * 2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def decode_logits(model, ids, mask, group: int, steps: int, lean: bool, compact_at: int | None = None):
    """Prefill `ids` for `group` samples each, then feed `steps` fixed tokens; return each step's logits.

    With `compact_at`, every other row leaves the batch before that step (a shared cache turns into plain rows).
    """
    compute = Compute.named("bf16_weights" if model.dtype == torch.bfloat16 else "fp32", torch.device("cpu"))
    cache = sampling_cache(model, ids.shape[1] + steps + 1)
    shared = group > 1
    with_cache = {cache_keyword(model): cache}
    step = lean_decode_step(model, cache, compute) if lean else None
    assert (step is not None) == lean
    rows = ids.shape[0] * group
    generator = torch.Generator().manual_seed(7)
    feed = torch.randint(2, 97, (steps, rows), generator=generator)
    position = (position_ids_from_mask(mask)[:, -1] + 1).repeat_interleave(group)
    outputs = []
    with torch.no_grad(), compute.autocast(), prepacked_linears(model, rows, compute):
        logits, attention_mask = cpu_sampler.prefill(model, ids, mask.long(), cache)
        cpu_sampler.spread_prompts(cache, with_cache, attention_mask, group, shared)
        attention_mask = attention_mask.repeat_interleave(group, dim=0)
        outputs.append(logits.repeat_interleave(group, dim=0))
        inputs = feed[0]
        for index in range(steps):
            if compact_at == index:
                keep = torch.arange(0, len(inputs), 2)
                cache.batch_select_indices(keep)
                with_cache.pop("prompt_cache", None)
                shared = False
                inputs, attention_mask, position = inputs[keep], attention_mask[keep], position[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(inputs), 1)], dim=1)
            if lean:
                logits = step(inputs, position, None if shared else attention_mask)
            else:
                logits = model(
                    input_ids=inputs[:, None],
                    attention_mask=None if shared else attention_mask,
                    position_ids=position[:, None],
                    **with_cache,
                    use_cache=True,
                ).logits[:, -1]
            outputs.append(logits)
            position = position + 1
            if index + 1 < steps:
                inputs = feed[index + 1][: len(position)]
    return outputs


def tiny_mistral():
    """Return a random Mistral of `TINY_SIZES` without a sliding window (Mistral 7B v0.2 on): a Llama's layers."""
    from transformers import MistralConfig, MistralForCausalLM

    from conftest import TINY_SIZES

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**TINY_SIZES, sliding_window=None, tie_word_embeddings=False))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("group", "compact_at"), [(1, None), (4, None), (4, 3)])
def test_the_lean_step_gives_the_forwards_logits_bit_for_bit(family, dtype, group, compact_at):
    model = prepared({"llama": tiny_llama, "qwen2": biased_qwen2, "mistral": tiny_mistral}[family](), dtype)
    ids, mask = prompts()
    forward = decode_logits(model, ids, mask, group, steps=6, lean=False, compact_at=compact_at)
    lean = decode_logits(model, ids, mask, group, steps=6, lean=True, compact_at=compact_at)
    assert len(forward) == len(lean) == 7
    for step, (expected, got) in enumerate(zip(forward, lean, strict=True)):
        assert got.dtype == expected.dtype and got.shape == expected.shape, step
        assert torch.equal(got, expected), f"step {step}: max difference {(got.float() - expected.float()).abs().max()}"


def test_the_sampler_writes_the_same_completions_with_and_without_the_lean_step(monkeypatch):
    model = prepared(tiny_llama(seed=2), torch.bfloat16)
    ids, mask = prompts(prompts_count=4, length=7)

    def sample():
        decoding = Decoding(max_new_tokens=12, temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(5))
        stopping = Stopping(stop_ids=[1, 5, 9], pad_id=0)  # common tokens: rows finish early and leave the batch
        return cpu_sampler.generate(
            model, ids, mask, decoding, stopping, compute=Compute.named("bf16_weights", "cpu"), samples_per_prompt=4
        )

    lean = sample()
    monkeypatch.setattr(cpu_sampler, "lean_decode_step", lambda *args: None)
    forward = sample()
    for got, expected in zip(lean, forward, strict=True):
        assert torch.equal(got, expected)
    assert bool((lean[1].sum(-1) < 12).any())  # some rows stopped early: compaction ran


def test_models_outside_the_known_families_decode_through_their_forward():
    cache = lambda model: sampling_cache(model, 16)  # noqa: E731
    llama = prepared(tiny_llama(), torch.float32)
    assert lean_decoder(llama, cache(llama)) is not None
    assert lean_decode_step(llama, cache(llama), Compute.named("fp32", "meta")) is None  # not the CPU

    sdpa = tiny_llama().eval()  # transformers' own attention: the forward's kernels are not polo's
    assert lean_decoder(sdpa, cache(sdpa)) is None

    sliding = tiny_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    sliding = prepared(sliding, torch.float32)
    assert lean_decoder(sliding, cache(sliding)) is None
