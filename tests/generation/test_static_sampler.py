"""The static-cache sampler run eagerly on the CPU: the same greedy tokens as the CPU sampler and transformers'
`generate` (Gemma 3's sliding window included), the same sampled tokens as the CPU sampler under one generator,
fixed shapes and addresses, and a compiled decode step that never recompiles."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from polo.generation import cpu_sampler, static_sampler
from polo.generation.prompts import stop_token_ids, tokenize_prompts
from polo.generation.rollouts import Decoding
from polo.generation.sampling import sample_next_token, sample_on_device
from polo.generation.stopping import Stopping
from polo.models.family import attention_window
from polo.models.loading import load_policy
from polo.runtime.device import CPU

PROMPTS = ["What is 1 + 2?", "A much longer prompt, so the others are left-padded: 17 * 3 = ", "x"]
WINDOW = 4  # the tiny Gemma's sliding window: far shorter than prompt + completion


def tiny_gemma3(tokenizer):
    """Return a tiny random Gemma 3 (sliding, full, sliding layers; window 4) over `tokenizer`'s vocabulary."""
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
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def policy(request, tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    if request.param == "gemma3":
        model = tiny_gemma3(tokenizer)
        assert attention_window(model) == WINDOW
    return model.eval(), tokenizer


def options(model, tokenizer, **overrides) -> dict:
    """Return `generate`'s keyword arguments: 16 greedy tokens, the model's stop ids, changed by `overrides` (a
    `Decoding` or `Stopping` field, or another keyword of `generate`)."""
    decoding = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0}
    stopping = {"stop_ids": stop_token_ids(tokenizer, model), "pad_id": tokenizer.pad_token_id}
    rest = {}
    for key, value in overrides.items():
        if key in {field.name for field in fields(Decoding)}:
            decoding[key] = value
        elif key in stopping:
            stopping[key] = value
        else:
            rest[key] = value
    return {"decoding": Decoding(**decoding), "stopping": Stopping(**stopping), **rest}


def seeded(settings: dict, seed: int) -> dict:
    """Return `settings` drawing from a fresh generator seeded `seed`."""
    return {**settings, "decoding": replace(settings["decoding"], generator=torch.Generator().manual_seed(seed))}


def until_stop(row: list[int], stop: list[int]) -> list[int]:
    cut = next((index + 1 for index, token in enumerate(row) if token in stop), len(row))
    return row[:cut]


@pytest.mark.parametrize("group_size", [1, 3])
def test_greedy_equals_the_cpu_sampler_and_transformers_generate(policy, group_size):
    model, tokenizer = policy
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS)
    settings = options(model, tokenizer, samples_per_prompt=group_size)
    static = static_sampler.generate(model, prompt_ids, prompt_mask, **settings)
    cpu = cpu_sampler.generate(model, prompt_ids, prompt_mask, **settings)
    for ours, theirs in zip(static, cpu):
        assert torch.equal(ours, theirs)
    expected = model.generate(
        input_ids=prompt_ids.repeat_interleave(group_size, 0),
        attention_mask=prompt_mask.repeat_interleave(group_size, 0),
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=list(settings["stopping"].stop_ids),
    )[:, prompt_ids.shape[1] :]
    completion_ids, completion_mask, _ = static
    got = [row[: int(length)] for row, length in zip(completion_ids.tolist(), completion_mask.sum(-1).tolist())]
    assert got == [until_stop(row, settings["stopping"].stop_ids) for row in expected.tolist()]
    assert prompt_ids.shape[1] + 16 > WINDOW  # the window cuts into every row


@pytest.mark.parametrize(
    "filters",
    [
        {"top_p": 1.0},
        {"top_p": 0.9},
        {"top_k": 5},
        {"min_p": 0.3},
        {"repetition_penalty": 1.5},
        {"top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2},
    ],
)
def test_sampled_tokens_equal_the_cpu_samplers_under_one_generator(policy, filters):
    """With no row stopping early both samplers draw one uniform per row per token, in one order: the same tokens,
    whatever filters and repetition penalty the draw applies."""
    model, tokenizer = policy
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS)
    never = [model.config.vocab_size + 7]  # a stop id no row can draw, so no row finishes (and is dropped) early
    settings = options(model, tokenizer, temperature=1.0, stop_ids=never, samples_per_prompt=3, **filters)
    static = static_sampler.generate(model, prompt_ids, prompt_mask, **seeded(settings, 3))
    cpu = cpu_sampler.generate(model, prompt_ids, prompt_mask, **seeded(settings, 3))
    for ours, theirs in zip(static, cpu):
        assert torch.equal(ours, theirs)
    assert static[0].shape == (9, 16) and len({tuple(row) for row in static[0].tolist()}) > 1


@pytest.mark.parametrize("sampler", [static_sampler, cpu_sampler])
def test_greedy_with_a_repetition_penalty_equals_transformers_generate(policy, sampler):
    """Greedy decoding under a repetition penalty is transformers' (each prompt alone: transformers also penalises the
    left padding of a batch, which polo leaves out); the penalty changes what greedy decoding writes."""
    model, tokenizer = policy
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS)
    settings = options(model, tokenizer, repetition_penalty=1.8, samples_per_prompt=2)
    completion_ids, completion_mask, _ = sampler.generate(model, prompt_ids, prompt_mask, **settings)
    got = [row[: int(length)] for row, length in zip(completion_ids.tolist(), completion_mask.sum(-1).tolist())]
    plain = sampler.generate(model, prompt_ids, prompt_mask, **options(model, tokenizer, samples_per_prompt=2))
    assert not torch.equal(plain[0], completion_ids)
    stop = settings["stopping"].stop_ids
    for index, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask)):
        alone = ids[mask.bool()][None]
        expected = model.generate(
            input_ids=alone,
            attention_mask=torch.ones_like(alone),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=list(stop),
        )[0, alone.shape[1] :]
        assert got[2 * index] == got[2 * index + 1] == until_stop(expected.tolist(), stop)


def test_sampled_tokens_agree_until_the_first_row_stops_and_repeat_under_the_same_seed(policy):
    """Once a row stops the CPU sampler draws fewer uniforms (it drops the row): the streams agree until then."""
    model, tokenizer = policy
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS)
    settings = options(model, tokenizer, temperature=1.0, max_new_tokens=24, samples_per_prompt=4)
    static = static_sampler.generate(model, prompt_ids, prompt_mask, **seeded(settings, 5))
    again = static_sampler.generate(model, prompt_ids, prompt_mask, **seeded(settings, 5))
    cpu = cpu_sampler.generate(model, prompt_ids, prompt_mask, **seeded(settings, 5))
    for first, second in zip(static, again):
        assert torch.equal(first, second)
    first_stop = int(static[1].sum(-1).min())  # the column in which the first row drew its stop token, plus one
    assert torch.equal(static[0][:, :first_stop], cpu[0][:, :first_stop])


def test_finished_rows_are_masked_and_nothing_moves(tiny_model_dir):
    """The decode batch never shrinks: a finished row writes pad under mask 0; a second call reuses every buffer."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    model.eval()
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS)
    settings = options(model, tokenizer, temperature=1.0, max_new_tokens=24, samples_per_prompt=4)

    def addresses(decoder) -> list[int]:
        buffers = [layer.keys for layer in decoder.cache.layers] + [decoder.tokens, decoder.finished]
        return [buffer.data_ptr() for buffer in buffers]

    torch.manual_seed(0)
    static_sampler.generate(model, prompt_ids, prompt_mask, **settings)
    (decoder,) = model.__dict__["_polo_static_decoders"].values()
    before = addresses(decoder)
    torch.manual_seed(1)
    ids, mask, truncated = static_sampler.generate(model, prompt_ids, prompt_mask, **settings)
    assert list(model.__dict__["_polo_static_decoders"].values()) == [decoder] and addresses(decoder) == before
    assert decoder.tokens.shape == (12,) and decoder.cache.layers[0].keys.shape[0] == 12
    stopped = ~truncated
    assert stopped.any() and truncated.any()
    for row in stopped.nonzero().squeeze(1).tolist():
        length = int(mask[row].sum())
        assert mask[row, :length].all() and not mask[row, length:].any()
        assert int(ids[row, length - 1]) in settings["stopping"].stop_ids
        assert (ids[row, length:] == tokenizer.pad_token_id).all()


def test_device_sampling_draws_what_the_cpu_draw_draws_and_matches_the_distribution():
    generator = torch.Generator()
    logits = torch.randn(64, 500) * 3
    for top_p in (1.0, 0.9, 0.3):
        generator.manual_seed(11)
        host = sample_next_token(logits, Decoding(1, 0.7, top_p, generator))
        generator.manual_seed(11)
        device = sample_on_device(logits, Decoding(1, 0.7, top_p, generator))
        assert torch.equal(host, device)
    toy = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]])).repeat(20000, 1)
    draws = sample_on_device(toy, Decoding(1, 1.0, 0.8, generator.manual_seed(0)))
    assert set(draws.tolist()) == {0, 1}  # 0.6 < 0.8 <= 0.85: the nucleus is the first two tokens
    assert abs((draws == 0).float().mean().item() - 0.6 / 0.85) < 0.015
    draws = sample_on_device(toy, Decoding(1, 1.0, 1.0, generator.manual_seed(1)))
    counts = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(counts, torch.tensor([0.6, 0.25, 0.1, 0.05]), atol=0.015, rtol=0)


def test_the_compiled_decode_step_never_recompiles_and_draws_what_eager_draws(tiny_model_dir):
    """torch.compile(fullgraph=True, dynamic=False) of the step (the CPU stand-in for CUDA-graph capture): one graph for
    every step and for a second call, the same tokens as the eager step (inductor told to draw with torch's own RNG)."""
    import torch._dynamo
    import torch._inductor.config

    model, tokenizer = load_policy(str(tiny_model_dir))
    model.eval()
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS[:2])
    never = [model.config.vocab_size + 7]
    settings = options(
        model,
        tokenizer,
        temperature=1.0,
        top_p=0.9,
        max_new_tokens=10,
        stop_ids=never,
        samples_per_prompt=2,
    )
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True), torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(4)
        compiled = static_sampler.generate(model, prompt_ids, prompt_mask, capture=True, **settings)
        torch.manual_seed(4)
        repeated = static_sampler.generate(model, prompt_ids, prompt_mask, capture=True, **settings)
    bucket = static_sampler.LENGTH_BUCKET  # what a captured decode pads prompts to
    padded_ids, padded_mask = static_sampler.left_pad(prompt_ids, prompt_mask, bucket, tokenizer.pad_token_id)
    torch.manual_seed(4)
    eager = static_sampler.generate(model, padded_ids, padded_mask, capture=False, **settings)
    torch._dynamo.reset()
    for ours, again, theirs in zip(compiled, repeated, eager):
        assert torch.equal(ours, again) and torch.equal(ours, theirs)
    assert compiled[0].shape == (4, 10)


def test_a_compiled_step_traces_lean_layers_and_a_checkpointed_model_in_any_number_of_decoders(
    tiny_model_dir, monkeypatch
):
    """The training run's model (polo's lean norms and MLPs, activation checkpointing on, the embeddings hooked as
    transformers 5.17's checkpointing hooks them) compiles whole, and a process may build more decoders (graphs) than
    Dynamo's recompile limit; each draws what the eager step draws, from the caller's generator."""
    import torch._dynamo

    from polo.kernels.lean import use_lean_layers
    from polo.models.loading import enable_activation_checkpointing

    model, tokenizer = load_policy(str(tiny_model_dir))
    assert use_lean_layers(model) > 0
    model.enable_input_require_grads()  # what transformers 5.17's gradient_checkpointing_enable does
    enable_activation_checkpointing(model)
    assert getattr(model, "_require_grads_hook", None) is None  # non-reentrant checkpointing does without it
    model.eval()
    never = [model.config.vocab_size + 7]
    settings = options(model, tokenizer, temperature=1.0, max_new_tokens=6, stop_ids=never)
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)  # a second decoder would exceed it
    bucket = static_sampler.LENGTH_BUCKET
    for group_size in (1, 2):  # two decode shapes: two decoders, two graphs of one method
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS[:2])
        compiled = static_sampler.generate(
            model, prompt_ids, prompt_mask, capture=True, samples_per_prompt=group_size, **seeded(settings, 6)
        )
        padded_ids, padded_mask = static_sampler.left_pad(prompt_ids, prompt_mask, bucket, tokenizer.pad_token_id)
        eager = static_sampler.generate(
            model, padded_ids, padded_mask, capture=False, samples_per_prompt=group_size, **seeded(settings, 6)
        )
        for ours, theirs in zip(compiled, eager):
            assert torch.equal(ours, theirs)
        assert compiled[0].shape == (2 * group_size, 6)
    assert sum(shape.captured for shape, _ in model.__dict__["_polo_static_decoders"]) == 2
    torch._dynamo.reset()


def test_the_cache_holds_values_in_their_own_dtype_under_autocast(tiny_model_dir, monkeypatch):
    """Under bf16 autocast the keys come out of the rotary embedding in fp32 and the values in bf16. A transformers
    that allocates both in the keys' dtype (5.17) made the first value write fail; the sampler keeps each in its own."""
    from transformers.cache_utils import StaticLayer

    from polo.runtime.device import Compute

    allocate = StaticLayer.lazy_initialization

    def as_keys(layer, key_states, value_states):  # transformers 5.17: the values in the keys' dtype
        allocate(layer, key_states, value_states.to(key_states.dtype))

    monkeypatch.setattr(StaticLayer, "lazy_initialization", as_keys)
    model, tokenizer = load_policy(str(tiny_model_dir))
    model.eval()
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS)
    settings = options(model, tokenizer, samples_per_prompt=2)
    autocast = Compute.named("bf16")
    static = static_sampler.generate(model, prompt_ids, prompt_mask, compute=autocast, **settings)
    cpu = cpu_sampler.generate(model, prompt_ids, prompt_mask, compute=autocast, **settings)
    for ours, theirs in zip(static, cpu):
        assert torch.equal(ours, theirs)
    (decoder,) = model.__dict__["_polo_static_decoders"].values()
    assert {(layer.keys.dtype, layer.values.dtype) for layer in decoder.cache.layers} == {
        (torch.float32, torch.bfloat16)
    }


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_captured_on_cuda_greedy_equals_transformers_generate(tiny_model_dir, family):
    """On a GPU the decode step is a CUDA graph (torch.compile, reduce-overhead): greedy still equals `generate`."""
    from polo.generation.grouped import pick_sampler
    from polo.runtime.device import Compute

    compute = Compute(torch.device("cuda"))
    model, tokenizer = load_policy(str(tiny_model_dir))
    model = (tiny_gemma3(tokenizer) if family == "gemma3" else model).to(compute.device).eval()
    assert pick_sampler("auto", compute) is static_sampler.rollout
    prompt_ids, prompt_mask = (tensor.to(compute.device) for tensor in tokenize_prompts(tokenizer, PROMPTS))
    settings = options(model, tokenizer, samples_per_prompt=2)
    for _ in range(2):  # the second call replays the captured graph
        ids, mask, _ = static_sampler.generate(model, prompt_ids, prompt_mask, compute=compute, **settings)
    expected = model.generate(
        input_ids=prompt_ids.repeat_interleave(2, 0),
        attention_mask=prompt_mask.repeat_interleave(2, 0),
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=list(settings["stopping"].stop_ids),
    )[:, prompt_ids.shape[1] :]
    assert ids.device.type == "cuda" and all(shape.captured for shape, _ in model.__dict__["_polo_static_decoders"])
    got = [row[: int(length)] for row, length in zip(ids.tolist(), mask.sum(-1).tolist())]
    assert got == [until_stop(row, settings["stopping"].stop_ids) for row in expected.tolist()]


def test_every_tensor_the_static_sampler_makes_names_its_device(tiny_model_dir):
    """The static sampler runs under the implicit-device guard (polo.runtime.guard): nothing lands on a default
    device."""
    from polo.runtime.device import CPU
    from polo.runtime.guard import implicit_device_guard

    model, tokenizer = load_policy(str(tiny_model_dir))
    model.eval()
    with implicit_device_guard():
        rollouts = static_sampler.rollout(model, tokenizer, PROMPTS, 2, Decoding(6, temperature=1.0), compute=CPU)
    assert rollouts.completion_ids.device == CPU.device and len(rollouts.texts) == 6


@pytest.mark.parametrize("sampler", [cpu_sampler, static_sampler])
def test_a_sampler_records_each_drawn_tokens_logprob_under_its_own_forward(policy, sampler):
    """With `Decoding.record_logprobs` a one-turn sampler keeps log softmax(z/T) of each token it drew (what the
    trainer's sampler correction compares with its own forward): in fp32 on the CPU, the trainer's scoring to 1e-5;
    0 at padding; and the same tokens as without recording."""
    from polo.generation.rollouts import one_turn_rollouts
    from polo.models.scoring import completion_logprobs

    model, tokenizer = policy
    decoding = Decoding(10, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(3))
    recorded = replace(decoding, generator=torch.Generator().manual_seed(3), record_logprobs=True)
    plain = one_turn_rollouts(sampler.generate, model, tokenizer, PROMPTS, 3, decoding, CPU)
    rollouts = one_turn_rollouts(sampler.generate, model, tokenizer, PROMPTS, 3, recorded, CPU)
    assert plain.sampling_logprobs is None and torch.equal(plain.completion_ids, rollouts.completion_ids)
    assert rollouts.sampling_logprobs.shape == rollouts.completion_ids.shape
    valid = rollouts.completion_mask.bool()
    assert torch.equal(rollouts.sampling_logprobs[~valid], torch.zeros(int((~valid).sum())))
    with torch.no_grad():
        scored, _ = completion_logprobs(
            model,
            rollouts.prompt_ids,
            rollouts.prompt_mask,
            rollouts.completion_ids,
            rollouts.completion_mask,
            temperature=0.7,
        )
    torch.testing.assert_close(rollouts.sampling_logprobs[valid], scored[valid].float(), atol=1e-5, rtol=1e-5)
    assert (rollouts.sampling_logprobs[valid] < 0).all()
