"""Mixture-of-experts models sample and train: a tiny random Qwen3-MoE and Mixtral (tests/models/families.py)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import yaml
from families import EOS, MOE_FAMILIES, char_tokenizer, save_family, tiny_family

from polo.config import ConfigError
from polo.core.routing import router_load
from polo.generation import cpu_sampler, static_sampler
from polo.generation.prompts import tokenize_prompts
from polo.generation.rollouts import Decoding
from polo.generation.stopping import Stopping
from polo.kernels import use_fast_attention, use_lean_layers
from polo.kernels.cpu.attention import plain_call
from polo.models.routing import check_router_loss, recorded_routing
from polo.models.scoring import completion_logprobs
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
    tokenizer = char_tokenizer("left")
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


def test_router_load_is_transformers_load_balancing_loss_over_real_tokens():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 5, 6, generator=generator) for _ in range(3))  # 3 layers, 2 rows x 5, 6 experts
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    load = router_load(list(logits), 2, mask.reshape(-1))
    torch.testing.assert_close(load.balancing_loss(), load_balancing_loss_func(logits, 6, 2, mask))
    assert float(load.expert_fractions().sum()) == pytest.approx(1.0)
    even = router_load([torch.zeros(4, 6)], 3)  # every expert equally likely: the loss is k
    assert float(even.balancing_loss()) == pytest.approx(3.0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_recorded_routing_of_a_scoring_forward_is_the_models_own_aux_loss(family):
    """Plain [prompt | completion] rows, padding on both sides: the model's own `aux_loss` (output_router_logits)."""
    tokenizer = char_tokenizer("left")
    reference = tiny_family(family, len(tokenizer))
    generator = torch.Generator().manual_seed(1)
    prompt_ids, completion_ids = torch.randint(3, 90, (4, 6), generator=generator), torch.randint(3, 90, (4, 5))
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    prompt_mask[0, :2], completion_mask[1, 3:] = 0, 0
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    expected = reference(
        input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), output_router_logits=True
    ).aux_loss
    model = copy.deepcopy(reference)
    use_fast_attention(model, CPU)
    with recorded_routing(model) as record:
        completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    torch.testing.assert_close(record.load().balancing_loss(), expected.float())
    with torch.no_grad(), recorded_routing(model) as record:  # a scoring without gradient is not the update's
        completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert record.load() is None
    dense = tiny_family("llama", len(tokenizer))
    with recorded_routing(dense) as record:
        assert record is None  # a dense model has no router
    check_router_loss(model, 0.01)
    with pytest.raises(ConfigError, match=r"algorithm.router_aux_loss_coef=0.01 .* LlamaForCausalLM has no router"):
        check_router_loss(dense, 0.01)


def test_polo_train_trains_a_mixture_of_experts_with_its_load_balancing_loss(tmp_path):
    """`polo train` through the real CLI on a tiny Qwen3-MoE with router_aux_loss_coef: the banner names its fallback
    once, every step logs the loss and the expert load, and the router moves."""
    model_dir = save_family("qwen3_moe", tmp_path / "moe")
    recipe = {
        "model": {"name": str(model_dir)},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 20, "num_eval": 2},
        "sampling": {"max_new_tokens": 6},
        "algorithm": {"group_size": 2, "router_aux_loss_coef": 0.5},
        "train": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 2, "precision": "fp32", "learning_rate": 0.01},
        "eval": {"batch_size": 2, "max_new_tokens": 4, "before": False, "after": False},
        "output": {"dir": str(tmp_path / "run"), "progress": False, "report_to": [], "plots": False},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    polo = [sys.executable, "-m", "polo", "train", str(tmp_path / "recipe.yaml")]
    result = subprocess.run(polo, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    # Qwen3-MoE decodes through its forward on the CPU (polo's lean decode step takes llama and qwen2): said once
    assert result.stdout.count("fallbacks: decode step through the model's forward") == 1, result.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "router/aux_loss" in row]
    assert len(steps) == 2
    for row in steps:
        loads = [row[f"router/expert_load/{expert:03d}"] for expert in range(4)]
        assert sum(loads) == pytest.approx(1.0) and max(loads) == row["router/expert_load/max"]
        assert 0.0 < row["router/aux_loss"] <= 8.0  # at most E·k: two of the 4 experts taking every token
    from safetensors.torch import load_file

    before = load_file(str(model_dir / "model.safetensors"))
    after = load_file(str(sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))
    router = "model.layers.0.mlp.gate.weight"
    assert torch.isfinite(after[router]).all() and not torch.equal(before[router], after[router])
