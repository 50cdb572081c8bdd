"""Sampling and scoring: padding never matters, the KV-cache sampler agrees with transformers."""

from __future__ import annotations

import pytest
import torch

from polo.generation.cpu_sampler import generate, rollout
from polo.generation.prompts import tokenize_prompts
from polo.generation.rollouts import Decoding
from polo.generation.stopping import Stopping
from polo.models.loading import load_policy
from polo.models.scoring import completion_logprobs


def test_greedy_sampler_matches_transformers_generate(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    prompts = ["What is 1 + 2?", "A much longer prompt, so the others are left-padded: 17 * 3 = "]
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)
    ours, mask, _ = generate(
        model, prompt_ids, prompt_mask, Decoding(12, temperature=0.0), Stopping.of(tokenizer, model)
    )
    assert_greedy_as_transformers(model, tokenizer, prompt_ids, prompt_mask, ours, mask)


def assert_greedy_as_transformers(model, tokenizer, prompt_ids, prompt_mask, ours, mask) -> None:
    """Assert each row of `ours` (its `mask` part, at least one token) is what transformers' greedy generate writes."""
    theirs = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        max_new_tokens=ours.shape[1],
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )[:, prompt_ids.shape[1] :]
    for row in range(prompt_ids.shape[0]):
        length = int(mask[row].sum())
        assert length > 0
        assert ours[row, :length].tolist() == theirs[row, :length].tolist()


def test_rollout_masks_and_truncation(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    torch.manual_seed(0)
    batch = rollout(model, tokenizer, ["1+1=", "2+2="], 4, Decoding(6, temperature=1.0))
    assert batch.completion_ids.shape[0] == 8 and batch.group_size == 4
    eos = tokenizer.eos_token_id
    for row in range(8):
        length = int(batch.completion_mask[row].sum())
        # the mask is a prefix of ones; a stop token, when present, is the last masked token
        assert batch.completion_mask[row, :length].all() and not batch.completion_mask[row, length:].any()
        stopped = length > 0 and int(batch.completion_ids[row, length - 1]) == eos
        assert bool(batch.truncated[row]) == (not stopped)
        assert not stopped or length <= 6
    # groups share their prompt
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[3]) and not torch.equal(
        batch.prompt_ids[3], batch.prompt_ids[4]
    )


def test_logprobs_do_not_depend_on_padding(tiny_model_dir):
    """A sequence scored alone and inside a padded batch gets the same log-probs on its real tokens."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    short_prompt, short_mask = tokenize_prompts(tokenizer, ["hi"])
    completion = torch.tensor([[5, 6, 7]])
    alone, _ = completion_logprobs(model, short_prompt, short_mask, completion, torch.ones_like(completion))

    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, ["hi", "a longer prompt here"])
    completions = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    batched, _ = completion_logprobs(model, prompt_ids, prompt_mask, completions, completion_mask)
    torch.testing.assert_close(batched[0, :3], alone[0], atol=1e-5, rtol=1e-5)

    # whatever token ids stand in padded positions, real positions score the same
    garbage = completions.clone()
    garbage[0, 3:] = torch.tensor([40, 41])
    prompt_garbage = prompt_ids.clone()
    prompt_garbage[prompt_mask == 0] = 42
    rescored, _ = completion_logprobs(model, prompt_garbage, prompt_mask, garbage, completion_mask)
    torch.testing.assert_close(rescored[0, :3], batched[0, :3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rescored[1], batched[1], atol=1e-5, rtol=1e-5)


def test_inverse_cdf_sampling_matches_the_distribution_and_skips_zero_weights():
    from polo.generation.sampling import inverse_cdf_sample

    torch.manual_seed(0)
    weights = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0]]).repeat(20000, 1)
    draws = inverse_cdf_sample(weights)
    counts = torch.bincount(draws, minlength=5).float() / len(draws)
    assert counts[1] == 0 and counts[4] == 0
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0]), atol=0.015, rtol=0)


def test_top_p_keeps_only_the_nucleus():
    from polo.generation.sampling import Decoding, sample_next_token

    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]])).repeat(5000, 1)
    draws = sample_next_token(logits, Decoding(1, temperature=1.0, top_p=0.8))
    assert set(draws.tolist()) == {0, 1}  # 0.6 < 0.8 <= 0.85: the first two tokens form the nucleus
    assert abs((draws == 0).float().mean().item() - 0.6 / 0.85) < 0.03


def test_top_p_over_a_large_vocabulary_matches_the_full_sort(monkeypatch):
    """The top-candidates shortcut and the full sort keep the same nucleus (both branches taken)."""
    from polo.generation import sampling as rollout_module

    torch.manual_seed(0)
    peaked = torch.randn(3, 5000) * 8  # the nucleus sits in the top candidates
    flat = torch.randn(3, 5000) * 0.1  # it does not: the full sort is used
    for logits in (peaked, flat):
        kept = []
        for candidates in (rollout_module.NUCLEUS_CANDIDATES, 10**9):
            monkeypatch.setattr(rollout_module, "NUCLEUS_CANDIDATES", candidates)
            torch.manual_seed(1)
            draws = rollout_module.sample_next_token(
                logits.repeat(200, 1), rollout_module.Decoding(1, temperature=1.0, top_p=0.9)
            )
            kept.append(draws)
        assert torch.equal(kept[0], kept[1])


def test_one_prefill_per_prompt_samples_like_repeated_prompts(tiny_model_dir):
    """samples_per_prompt=3 (the prompt run once, its cache repeated) draws what 3 copies of the prompt draw."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, ["1+1=", "a longer prompt: 12+30="])
    options = (Decoding(8, temperature=1.0, top_p=1.0), Stopping.of(tokenizer, model))
    torch.manual_seed(5)
    shared = generate(model, prompt_ids, prompt_mask, *options, samples_per_prompt=3)
    torch.manual_seed(5)
    repeated = generate(model, prompt_ids.repeat_interleave(3, 0), prompt_mask.repeat_interleave(3, 0), *options)
    assert shared[0].shape[0] == 6
    for ours, theirs in zip(shared, repeated):
        assert torch.equal(ours, theirs)
    assert not all(torch.equal(shared[0][0], shared[0][row]) for row in (1, 2))  # the samples of a prompt differ


def test_prepacked_linears_give_the_plain_layers_outputs_and_are_removed(tiny_model_dir):
    """bf16 linear layers with oneDNN-packed weights: same logits bit for bit; plain layers again afterwards."""
    from polo.kernels.cpu.linear import _can_prepack, prepacked_linears

    model, _ = load_policy(str(tiny_model_dir))
    model.to(torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 5))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with prepacked_linears(model, batch_hint=3):
            patched = [m for m in linears if "forward" in vars(m)]
            packed = model(input_ids=ids).logits
    # Where the CPU has native bf16 (this project's machines) every layer is packed; elsewhere none is.
    assert len(patched) == (len(linears) if _can_prepack() else 0)
    assert torch.equal(packed, plain)
    assert not any("forward" in vars(m) for m in linears)  # the class forward is back


def test_fp32_linears_are_packed_only_where_measured_faster_and_without_autocast(tiny_model_dir, monkeypatch):
    """fp32 layers go through oneDNN's packed matmul where the rate probe found it faster than torch's own fp32
    matmul (MKL's, at half oneDNN's rate on an AMD EPYC), never under bf16 autocast; outputs agree to rounding."""
    import polo.kernels as kernels
    from polo.kernels.cpu import linear as cpu_linear
    from polo.runtime.device import Compute
    from polo.runtime.rates import MatmulRates, pack_linear_weight

    model, _ = load_policy(str(tiny_model_dir))
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 5))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    packs = pack_linear_weight(linears[0].weight.detach(), 3) is not None
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        for packed_rate, compute, expected in (
            (900.0, Compute(torch.device("cpu")), len(linears) if packs else 0),
            (100.0, Compute(torch.device("cpu")), 0),  # measured slower than torch's fp32: left alone
            (900.0, Compute.named("bf16"), 0),  # autocast recasts the inputs: a packed fp32 weight would skip it
        ):
            rates = MatmulRates(fp32=200.0, bf16=150.0, cached=True, fp32_packed=packed_rate)
            monkeypatch.setattr(cpu_linear, "cached_rates", lambda rates=rates: rates)
            kernels.packed_fp32_pays.cache_clear()  # asked once per process: ask again with these rates
            with kernels.prepacked_linears(model, 3, compute):
                assert len([m for m in linears if "forward" in vars(m)]) == expected
                logits = model(input_ids=ids).logits
            torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-4)
            assert not any("forward" in vars(m) for m in linears)
    kernels.packed_fp32_pays.cache_clear()


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_shared_prompt_cache_samples_what_repeated_prompts_sample(tiny_model_dir, monkeypatch, request, native):
    """With polo's attention a group reads one copy of its prompt until rows first leave the batch, then plain rows:
    the same tokens as a cache holding the prompt once per row, finished rows and all, with polo's native decode
    kernel and with its torch path."""
    from polo.generation import cpu_sampler
    from polo.kernels.cpu import attention, kv_cache

    if native:
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setattr(attention, "native_ops", lambda: None)
    model, tokenizer = load_policy(str(tiny_model_dir))
    assert attention.use_polo_attention(model)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, ["1+1=", "a longer prompt: 12+30=", "7*8="])
    # one token in 25 ends a row, so rows finish at different steps and leave the batch
    stopping = Stopping(stop_ids=tuple(range(0, model.config.vocab_size, 25)), pad_id=tokenizer.pad_token_id)
    calls = {"shared": 0, "unshared": 0}
    decode, native_decode, plain_rows = (
        attention.shared_prompt_decode,
        attention.native_decode,
        kv_cache.SharedPrompt.plain_rows,
    )

    def counted_decode(*args):
        calls["shared"] += 1
        return decode(*args)

    def counted_native(query, keys, values, valid, shared, scaling):
        out = native_decode(query, keys, values, valid, shared, scaling)
        calls["shared"] += out is not None and shared is not None
        return out

    def counted_plain_rows(self, indices):
        calls["unshared"] += 1
        return plain_rows(self, indices)

    monkeypatch.setattr(attention, "shared_prompt_decode", counted_decode)
    monkeypatch.setattr(attention, "native_decode", counted_native)
    monkeypatch.setattr(kv_cache.SharedPrompt, "plain_rows", counted_plain_rows)
    results = []
    for share in (True, False):
        monkeypatch.setattr(cpu_sampler, "shares_prompts", lambda model, cache, share=share: share)
        torch.manual_seed(11)
        results.append(generate(model, prompt_ids, prompt_mask, Decoding(16), stopping, samples_per_prompt=4))
    assert calls["shared"] > 0 and calls["unshared"] == model.config.num_hidden_layers  # shared, then plain rows
    lengths = results[0][1].sum(-1)
    assert lengths.min() < lengths.max()  # rows did finish apart
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)


def test_shared_prompt_rows_become_plain_rows_with_their_prompt_in_front():
    from polo.kernels.cpu.kv_cache import SharedPrompt

    torch.manual_seed(0)
    prompts, heads, length, group, dim = 2, 3, 5, 4, 8
    keys, values = torch.randn(2, prompts, heads, length, dim)
    mask = torch.ones(prompts, length, dtype=torch.long)
    mask[1, :2] = 0
    shared = SharedPrompt(keys, values, mask, group, capacity=6)
    own_keys, own_values = torch.randn(2, prompts * group, heads, 3, dim)
    shared.append(own_keys[:, :, :2], own_values[:, :, :2])
    got_keys, got_values = shared.append(own_keys[:, :, 2:], own_values[:, :, 2:])
    assert got_keys.shape == (prompts, heads, group, 3, dim)
    torch.testing.assert_close(got_keys[1, :, 2], own_keys[group + 2])  # prompt 1's third row
    assert torch.isinf(shared.prompt_bias.view(prompts, heads, length)[1, :, :2]).all()
    keep = torch.tensor([0, 3, 5, 6])
    plain_keys, plain_values, filled = shared.plain_rows(keep)
    assert filled == length + 3 and plain_keys.shape == (4, heads, length + 6, dim)
    for expected, plain, prompt in ((own_keys, plain_keys, keys), (own_values, plain_values, values)):
        full = torch.cat([prompt.repeat_interleave(group, 0), expected], dim=2)[keep]
        torch.testing.assert_close(plain[:, :, :filled], full)


def test_prompts_with_a_common_prefix_run_it_once_and_decode_as_transformers_does(tiny_model_dir, monkeypatch):
    """Greedy decoding of prompts behind one long system text: the same tokens as transformers' generate, with that
    text run through the model once (one row) and then only each prompt's own tokens."""
    from polo.generation import cpu_sampler
    from polo.kernels import common_prefix_length

    model, tokenizer = load_policy(str(tiny_model_dir))
    system = "You are a careful calculator. Think step by step, then give only the final number. " * 2
    prompts = [system + question for question in ("1+2=", "What is seventeen times three? ", "9-4=")]
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)
    prefix = common_prefix_length(prompt_ids, prompt_mask)
    assert prefix >= cpu_sampler.MIN_COMMON_PREFIX
    batches = []
    real_forward = model.forward

    def recorded_forward(*args, **kwargs):
        batches.append(tuple(kwargs["input_ids"].shape))
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recorded_forward)
    ours, mask, _ = generate(
        model, prompt_ids, prompt_mask, Decoding(10, temperature=0.0), Stopping.of(tokenizer, model)
    )
    assert batches[:2] == [(1, prefix), (3, prompt_ids.shape[1] - prefix)]  # the prefix once, then the rest
    monkeypatch.setattr(model, "forward", real_forward)
    assert_greedy_as_transformers(model, tokenizer, prompt_ids, prompt_mask, ours, mask)


def test_common_prefix_layout_moves_padding_behind_the_prefix():
    from polo.generation.cpu_sampler import prefix_first
    from polo.kernels import common_prefix_length

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 9, 9], [0, 5, 6, 7, 1, 2]])
    mask = (ids != 0).long()
    assert common_prefix_length(ids, mask) == 3
    moved_ids, moved_mask = prefix_first(ids, mask, 3)
    assert moved_ids.tolist() == [[5, 6, 7, 0, 0, 8], [5, 6, 7, 9, 9, 9], [5, 6, 7, 0, 1, 2]]
    assert moved_mask.tolist() == [[1, 1, 1, 0, 0, 1], [1] * 6, [1, 1, 1, 0, 1, 1]]
    assert common_prefix_length(ids[:, :3], mask[:, :3]) == 1  # at most the shortest prompt (row 0: one token)
    assert (
        common_prefix_length(ids, torch.ones_like(mask).index_fill_(1, torch.tensor([3]), 0)) == 0
    )  # not left padding
    assert common_prefix_length(ids[1:2], mask[1:2]) == 6  # a single row shares all of itself
