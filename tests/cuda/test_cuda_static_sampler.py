"""The static-cache sampler on CUDA, its decode step captured (torch.compile "reduce-overhead": CUDA graphs):
greedy tokens equal `transformers.generate`'s, and the eager step's, on a tiny Llama and a tiny Gemma 3 (sliding
window)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama

pytestmark = pytest.mark.cuda

PROMPTS = ["What is 1 + 2?", "A much longer prompt, so the others are left-padded: 17 * 3 = ", "x"]
MAX_NEW_TOKENS = 20  # more than CHECK_EVERY, so the decode runs past an "all finished?" check


def tiny_gemma3(tokenizer):
    """Return a tiny random Gemma 3 (sliding, full, sliding layers with a window of 4) over `tokenizer`'s vocabulary."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return Gemma3ForCausalLM(config)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def cuda_policy(request, tiny_model_dir):
    """Return (model on CUDA in fp32, tokenizer, its Compute)."""
    from polo.models.loading import load_policy
    from polo.runtime.device import Compute

    model, tokenizer = load_policy(str(tiny_model_dir))
    if request.param == "gemma3":
        model = tiny_gemma3(tokenizer)
    compute = Compute.named("fp32", torch.device("cuda", torch.cuda.current_device()))
    return model.to(compute.device).eval(), tokenizer, compute


def until_stop(row: list[int], stop: list[int]) -> list[int]:
    cut = next((index + 1 for index, token in enumerate(row) if token in stop), len(row))
    return row[:cut]


def completions(completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[list[int]]:
    return [row[: int(length)] for row, length in zip(completion_ids.tolist(), completion_mask.sum(-1).tolist())]


@pytest.mark.parametrize("group_size", [1, 3])
def test_captured_greedy_equals_transformers_generate_on_cuda(cuda_policy, group_size):
    from polo.generation import static_sampler
    from polo.generation.prompts import stop_token_ids, tokenize_prompts
    from polo.generation.rollouts import Decoding
    from polo.generation.stopping import Stopping

    model, tokenizer, compute = cuda_policy
    prompt_ids, prompt_mask = (tensor.to(compute.device) for tensor in tokenize_prompts(tokenizer, PROMPTS))
    stop_ids = stop_token_ids(tokenizer, model)
    completion_ids, completion_mask, truncated = static_sampler.generate(
        model,
        prompt_ids,
        prompt_mask,
        Decoding(MAX_NEW_TOKENS, temperature=0.0, top_p=1.0),
        Stopping(stop_ids, tokenizer.pad_token_id),
        compute=compute,
        samples_per_prompt=group_size,
    )  # capture defaults to True on CUDA
    assert completion_ids.device == compute.device and truncated.shape == (len(PROMPTS) * group_size,)
    with torch.no_grad():
        expected = model.generate(
            input_ids=prompt_ids.repeat_interleave(group_size, 0),
            attention_mask=prompt_mask.repeat_interleave(group_size, 0),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop_ids,
        )[:, prompt_ids.shape[1] :]
    assert completions(completion_ids, completion_mask) == [until_stop(row, stop_ids) for row in expected.tolist()]


def test_the_captured_step_gives_the_eager_steps_tokens_and_is_reused(cuda_policy):
    from polo.generation import static_sampler
    from polo.generation.rollouts import Decoding

    model, tokenizer, compute = cuda_policy
    settings = dict(decoding=Decoding(MAX_NEW_TOKENS, temperature=0.0), compute=compute)
    captured = static_sampler.rollout(model, tokenizer, PROMPTS, 2, capture=True, **settings)
    eager = static_sampler.rollout(model, tokenizer, PROMPTS, 2, capture=False, **settings)
    assert torch.equal(captured.completion_ids, eager.completion_ids) and captured.texts == eager.texts
    decoders = dict(model.__dict__["_polo_static_decoders"])
    again = static_sampler.rollout(
        model, tokenizer, PROMPTS, 2, capture=True, **settings
    )  # the kept decoder, its graph replayed
    assert torch.equal(again.completion_ids, captured.completion_ids)
    assert dict(model.__dict__["_polo_static_decoders"]) == decoders  # nothing was built anew


def test_the_training_runs_model_samples_captured_over_a_full_vocabulary(tiny_model_dir):
    """What `polo train` samples with on a GPU, which the greedy tests above missed: polo's lean layers, activation
    checkpointing, bf16 autocast, temperature 1 over SmolLM2's 49,152-token vocabulary. On an H200 this failed at
    each of them in turn (docs/gpu.md); it draws valid, varied tokens that repeat under one seed."""
    from polo.generation import static_sampler
    from polo.generation.prompts import tokenize_prompts
    from polo.generation.rollouts import Decoding
    from polo.generation.stopping import Stopping
    from polo.kernels.lean import use_lean_layers
    from polo.models.loading import enable_activation_checkpointing, load_policy
    from polo.runtime.device import Compute

    _, tokenizer = load_policy(str(tiny_model_dir))
    vocab = 49_152
    model = tiny_llama(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    compute = Compute.named("bf16", torch.device("cuda", torch.cuda.current_device()))
    model = model.to(compute.device)
    assert use_lean_layers(model) > 0
    enable_activation_checkpointing(model)
    model.eval()
    prompt_ids, prompt_mask = (tensor.to(compute.device) for tensor in tokenize_prompts(tokenizer, PROMPTS))
    never = (vocab + 7,)  # no row stops, so every row draws every token

    def draw(seed: int) -> torch.Tensor:
        decoding = Decoding(MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, generator=compute.generator(seed))
        ids, mask, _ = static_sampler.generate(
            model,
            prompt_ids,
            prompt_mask,
            decoding,
            Stopping(never, tokenizer.pad_token_id),
            compute=compute,
            samples_per_prompt=8,
        )
        assert bool(mask.all())
        return ids

    first, again, other = draw(1), draw(1), draw(2)
    assert first.shape == (len(PROMPTS) * 8, MAX_NEW_TOKENS) and first.device == compute.device
    assert int(first.min()) >= 0 and int(first.max()) < vocab
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert len({tuple(row) for row in first.tolist()}) == first.shape[0]  # a random model: every row its own
    assert all(shape.captured for shape, _ in model.__dict__["_polo_static_decoders"])
