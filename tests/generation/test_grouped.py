"""polo's one grouped sampler (`sample_groups`): prompt order, whole groups per batch, the same samples as the
pipeline's grouped sampler it replaced, greedy answers as before; the sampler choice and loading for sampling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from polo.config import ConfigError, load_config
from polo.generation import cpu_sampler, static_sampler
from polo.generation.grouped import (
    Completion,
    GroupSampling,
    group_batches,
    load_for_sampling,
    pick_sampler,
    sample_groups,
)
from polo.generation.rollouts import Decoding
from polo.models.family import encode_prompts
from polo.runtime.device import CPU, Compute

PROMPTS = ["What is 12 + 30?", "Hi", "A much longer prompt than the others, to force padding.", "2+2=", "Say yes."]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_for_sampling(str(tiny_model_dir), CPU)


def test_batches_go_shortest_first_and_hold_whole_groups():
    assert group_batches([5, 1, 3, 1, 9], samples_per_prompt=2, batch_size=5) == [[1, 3], [2, 0], [4]]
    assert group_batches([5, 1, 3], samples_per_prompt=8, batch_size=4) == [[1], [2], [0]]  # at least one a batch
    with pytest.raises(ValueError, match="samples_per_prompt"):
        group_batches([1], samples_per_prompt=0, batch_size=4)


def test_sample_groups_calls_the_sampler_with_whole_groups_and_returns_prompt_order(policy):
    model, tokenizer = policy
    calls = []

    def recording(model, tokenizer, prompts, group_size, decoding, **settings):
        calls.append((list(prompts), group_size, settings["compute"]))
        return cpu_sampler.rollout(model, tokenizer, prompts, group_size, decoding, **settings)

    settings = GroupSampling(samples=3, max_new_tokens=5, temperature=1.0, batch_size=7, sampler=recording)
    results = sample_groups(model, tokenizer, PROMPTS, settings)
    lengths = [len(ids) for ids in encode_prompts(tokenizer, PROMPTS)]
    order = sorted(range(len(PROMPTS)), key=lambda index: lengths[index])
    batches = [order[:2], order[2:4], order[4:]]  # 7 // 3 = 2 prompts a batch
    assert [prompts for prompts, _, _ in calls] == [[PROMPTS[i] for i in batch] for batch in batches]
    assert all(group_size == 3 and compute == CPU for _, group_size, compute in calls)
    assert [len(samples) for samples in results] == [3] * len(PROMPTS)
    assert all(isinstance(sample, Completion) and 1 <= sample.length <= 5 for samples in results for sample in samples)


def old_grouped_completions(model, tokenizer, prompts, samples, *, max_new_tokens, temperature, top_p, batch_size):
    """The pipeline's grouped sampler as it was (polo.pipeline.sampling.grouped_completions, deleted): the reference."""
    lengths = [len(ids) for ids in encode_prompts(tokenizer, prompts)]
    order = sorted(range(len(prompts)), key=lambda index: lengths[index])
    per_batch = max(1, batch_size // samples)
    results = [[] for _ in prompts]
    for start in range(0, len(order), per_batch):
        chunk = order[start : start + per_batch]
        sampled = cpu_sampler.rollout(
            model,
            tokenizer,
            [prompts[index] for index in chunk],
            samples,
            Decoding(max_new_tokens, temperature, top_p),
        )
        counts, cut = sampled.completion_mask.sum(-1).tolist(), sampled.truncated.tolist()
        for row, text in enumerate(sampled.texts):
            sample = {"text": text, "length": int(counts[row]), "truncated": bool(cut[row])}
            results[chunk[row // samples]].append(sample)
    return results


@pytest.mark.parametrize("samples, temperature, top_p", [(1, 0.0, 1.0), (4, 1.0, 0.9)])
def test_sample_groups_draws_what_the_pipelines_grouped_sampler_drew(policy, samples, temperature, top_p):
    model, tokenizer = policy
    settings = dict(max_new_tokens=8, temperature=temperature, top_p=top_p, batch_size=8)
    torch.manual_seed(7)
    new = sample_groups(model, tokenizer, PROMPTS, GroupSampling(samples=samples, **settings))
    torch.manual_seed(7)
    old = old_grouped_completions(model, tokenizer, PROMPTS, samples, **settings)
    fields = ("text", "length", "truncated")  # a one-turn completion has no episode record
    assert [[{key: getattr(sample, key) for key in fields} for sample in done] for done in new] == old
    assert all(sample.episode is None for done in new for sample in done)


def test_greedy_single_samples_are_each_prompt_decoded_alone(policy):
    model, tokenizer = policy
    greedy = GroupSampling(max_new_tokens=6, temperature=0.0)
    batched = sample_groups(model, tokenizer, PROMPTS, replace(greedy, batch_size=2))
    for prompt, (sample,) in zip(PROMPTS, batched):
        (alone,) = sample_groups(model, tokenizer, [prompt], greedy)[0]
        assert sample == alone


def test_the_static_sampler_behind_sample_groups_gives_the_same_greedy_answers(policy):
    model, tokenizer = policy
    settings = dict(max_new_tokens=8, temperature=0.0, batch_size=6)
    cpu = sample_groups(model, tokenizer, PROMPTS, GroupSampling(samples=2, sampler=cpu_sampler.rollout, **settings))
    static = sample_groups(
        model, tokenizer, PROMPTS, GroupSampling(samples=2, sampler=static_sampler.rollout, **settings)
    )
    assert cpu == static


def test_the_sampler_is_chosen_in_one_place_from_the_compute():
    cuda = Compute(torch.device("cuda", 0))  # a description only: nothing is allocated on it
    assert pick_sampler("auto", CPU) is cpu_sampler.rollout
    assert pick_sampler("auto", cuda) is static_sampler.rollout
    assert pick_sampler("kv_cache", cuda) is cpu_sampler.rollout
    assert pick_sampler("static", CPU) is static_sampler.rollout
    with pytest.raises(
        ValueError, match="sampling.sampler: .vllm. is not a registered sampler; registered: auto, kv_cache, static"
    ):
        pick_sampler("vllm", CPU)
    assert load_config({}).sampling.sampler == "auto"
    with pytest.raises(ConfigError, match="sampling.sampler"):
        load_config({"sampling": {"sampler": "vllm"}})


def test_load_for_sampling_gives_an_eval_model_in_the_computes_dtype(tiny_model_dir):
    model, tokenizer = load_for_sampling(str(tiny_model_dir), Compute.named("bf16_weights"))
    assert not model.training and tokenizer.padding_side == "left"
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
    assert {parameter.device.type for parameter in model.parameters()} == {"cpu"}
