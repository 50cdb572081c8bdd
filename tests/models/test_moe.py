"""Mixture-of-experts models sample and train: a tiny random Qwen3-MoE and Mixtral (tests/models/families.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from families import EOS, MOE_FAMILIES, char_tokenizer, tiny_family

from polo.generation import cpu_sampler, static_sampler
from polo.generation.prompts import tokenize_prompts
from polo.generation.rollouts import Decoding
from polo.generation.stopping import Stopping
from polo.kernels import use_fast_attention, use_lean_layers
from polo.kernels.cpu.attention import plain_call
from polo.runtime.device import CPU

PROMPTS = ["What is 1 + 2?", "A longer prompt, so the others are left-padded: 17 * 3 = ", "x"]


def test_a_routers_output_flag_leaves_attention_plain():
    """A mixture-of-experts forward hands `output_router_logits` to every attention call; it changes no maths."""
    query, key = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 3, 8)
    assert plain_call(query, key, (), {"scaling": 0.3, "output_router_logits": False, "output_hidden_states": True})
    assert not plain_call(query, key, (), {"softcap": 50.0})


@pytest.mark.parametrize("sampler", [cpu_sampler, static_sampler], ids=["cpu_sampler", "static_sampler"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_samples_over_shared_prompts_are_generates(family, sampler):
    """Each prompt held once for its group in the cache (polo's attention reads it per group): generate's tokens."""
    tokenizer = char_tokenizer()
    reference = tiny_family(family, len(tokenizer))
    model = copy.deepcopy(reference)
    assert use_fast_attention(model, CPU)
    use_lean_layers(model)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, PROMPTS)
    completion_ids, completion_mask, _ = sampler.generate(
        model,
        prompt_ids,
        prompt_mask,
        Decoding(max_new_tokens=8, temperature=0.0),
        Stopping(stop_ids=(EOS,), pad_id=EOS),
        samples_per_prompt=3,
    )
    expected = reference.generate(
        input_ids=prompt_ids.repeat_interleave(3, 0),
        attention_mask=prompt_mask.repeat_interleave(3, 0),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=EOS,
        eos_token_id=[EOS],
    )[:, prompt_ids.shape[1] :]
    for row, mask, want in zip(completion_ids.tolist(), completion_mask.tolist(), expected.tolist()):
        length = sum(mask)
        assert row[:length] == want[:length]
