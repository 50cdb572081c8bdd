"""SFT, reward models and DPO on `polo train`'s fast paths: its precision, polo's attention, the unpadded layout."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from test_dpo import rankings_file
from test_sft import tiny_recipe

from polo.data.preferences import Demonstration, Ranking, read_demonstrations
from polo.finetune.dpo import dpo
from polo.finetune.fit import (
    collate_rankings,
    prepare_model,
    ranking_logprobs,
    ranking_rewards,
    recomputes_activations,
    sequence_logprobs,
    sequence_rewards,
)
from polo.finetune.reward_model import encode_rankings, new_reward_model, train_reward_model
from polo.finetune.sft import SFTObjective, encode_demonstrations, sft
from polo.kernels import without_padding
from polo.kernels.cpu.attention import POLO_ATTENTION
from polo.models import scoring
from polo.models.loading import enable_activation_checkpointing, load_policy, load_tokenizer
from polo.runtime.device import CPU

DEMOS = [
    Demonstration(({"role": "user", "content": f"What is {i} + {i}?"},), f"{i} + {i} = {2 * i}. " * (i + 1))
    for i in range(3)
]
RANKINGS = [
    Ranking(({"role": "user", "content": "Say 1."},), ("1", "one, I think so", "111")),
    Ranking(({"role": "user", "content": "A longer prompt here?"},), ("x", "yy")),
]


def sft_loss_and_gradient(model, examples, pad_id: int) -> tuple[float, torch.Tensor]:
    """Return the SFT loss of `examples` and its gradient on the first layer's query projection."""
    model.zero_grad()
    loss, _ = SFTObjective(pad_id).loss(model, examples)
    loss.backward()
    return loss.item(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_sft_batches_run_unpadded_on_polo_attention_with_sdpas_loss_and_gradient(
    tiny_model_dir, monkeypatch, gradient_checkpointing
):
    plain, tokenizer = load_policy(str(tiny_model_dir))
    examples = encode_demonstrations(tokenizer, DEMOS, None, 128)
    assert len({len(example.sequences[0].response_ids) for example in examples}) == 3  # padding to leave out
    expected = sft_loss_and_gradient(plain, examples, tokenizer.pad_token_id)

    trainee = prepare_model(load_policy(str(tiny_model_dir))[0], CPU, gradient_checkpointing)
    trainee.model.train()  # as fit trains it
    assert trainee.model.config._attn_implementation == POLO_ATTENTION and trainee.masters is None
    assert recomputes_activations(trainee.model) == gradient_checkpointing
    unpadded = []
    monkeypatch.setattr(scoring, "without_padding", lambda shared: unpadded.append(shared) or without_padding(shared))
    loss, gradient = sft_loss_and_gradient(trainee.model, examples, tokenizer.pad_token_id)
    assert unpadded, "the SFT batch did not take the unpadded layout"
    assert loss == pytest.approx(expected[0], rel=1e-5)
    torch.testing.assert_close(gradient, expected[1], rtol=1e-4, atol=1e-6)


def test_activations_are_recomputed_only_in_training_with_gradients(tiny_model_dir):
    """Only then does transformers drop the KV cache that the shared prompt of a ranking passes on."""
    model, _ = load_policy(str(tiny_model_dir))
    assert not recomputes_activations(model)
    enable_activation_checkpointing(model)
    model.train()
    assert recomputes_activations(model)
    with torch.no_grad():
        assert not recomputes_activations(model)
    model.eval()
    assert not recomputes_activations(model)


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_dpo_rankings_score_alike_on_polo_attention(tiny_model_dir, gradient_checkpointing):
    """Each prompt once (recomputing activations: each sequence whole) on polo's attention = sdpa, one by one."""
    plain, tokenizer = load_policy(str(tiny_model_dir))
    batch = collate_rankings(encode_rankings(tokenizer, RANKINGS, None, 128), tokenizer.pad_token_id)
    expected = sequence_logprobs(plain, batch.expanded())
    expected.sum().backward()
    trainee = prepare_model(load_policy(str(tiny_model_dir))[0], CPU, gradient_checkpointing)
    trainee.model.train()
    values = ranking_logprobs(trainee.model, batch)
    values.sum().backward()
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-4)
    for name in ("q_proj", "v_proj"):
        ours = getattr(trainee.model.model.layers[0].self_attn, name).weight.grad
        torch.testing.assert_close(
            ours, getattr(plain.model.layers[0].self_attn, name).weight.grad, rtol=1e-4, atol=1e-6
        )


def test_a_reward_model_scores_alike_on_polo_attention(tiny_model_dir):
    """A sequence classifier switches to polo's attention too, and its rankings' rewards stay sdpa's."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    torch.manual_seed(0)
    plain = new_reward_model(str(tiny_model_dir), tokenizer)
    torch.manual_seed(0)  # the same new head
    trainee = prepare_model(new_reward_model(str(tiny_model_dir), tokenizer), CPU)
    assert trainee.model.config._attn_implementation == POLO_ATTENTION
    batch = collate_rankings(encode_rankings(tokenizer, RANKINGS, None, 128), tokenizer.pad_token_id)
    torch.testing.assert_close(
        ranking_rewards(trainee.model, batch), sequence_rewards(plain, batch.expanded()), rtol=1e-5, atol=1e-5
    )


def step_losses(result) -> list[float]:
    return [row["loss"] for row in result.metrics if "loss" in row]


def test_bf16_master_sft_learns_as_fp32_does_and_saves_fp32_weights(tiny_model_dir, tmp_path, capsys):
    runs = {
        precision: sft(
            tiny_recipe(
                tiny_model_dir, tmp_path, train={"precision": precision}, output={"dir": str(tmp_path / precision)}
            )
        )
        for precision in ("fp32", "bf16_master")
    }
    assert "polo sft: 8 examples, 6 steps of 4 | bf16_master on cpu (explicit)" in capsys.readouterr().out
    fp32, bf16 = step_losses(runs["fp32"]), step_losses(runs["bf16_master"])
    assert bf16[-1] < bf16[0] - 0.5 and runs["bf16_master"].eval_after["loss"] < runs["bf16_master"].eval_before["loss"]
    assert bf16 == pytest.approx(fp32, rel=0.02)  # six steps at a high rate: bf16 rounding, not a different course
    assert runs["bf16_master"].eval_after["loss"] == pytest.approx(runs["fp32"].eval_after["loss"], rel=0.02)
    # what is saved is the fp32 masters, declared as such: from_pretrained loads fp32 weights that learned
    model_dir = runs["bf16_master"].model_dir
    weights = load_file(str(model_dir / "model.safetensors"))
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "float32"
    assert POLO_ATTENTION not in (model_dir / "config.json").read_text()
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    changed = [name for name in start if not torch.equal(start[name], weights[name])]
    assert changed and any((weights[name] != weights[name].bfloat16().float()).any() for name in changed)


def test_tokens_per_second_counts_every_real_token_of_each_step(tiny_model_dir, tmp_path):
    """Σ tokens_per_second × time/step over three epochs = 3 × the demonstrations' prompt + response tokens."""
    recipe = tiny_recipe(tiny_model_dir, tmp_path)
    result = sft(recipe)
    rows = [row for row in result.metrics if "loss" in row]
    assert all(row["tokens_per_second"] > 0 for row in rows)
    _, tokenizer = load_policy(str(tiny_model_dir))
    examples = encode_demonstrations(tokenizer, read_demonstrations(recipe["data"]["train_path"]), None, 512)
    tokens = sum(len(example.sequences[0].prompt_ids) + len(example.sequences[0].response_ids) for example in examples)
    counted = sum(row["tokens_per_second"] * row["time/step"] for row in rows)
    assert counted == pytest.approx(3 * tokens, rel=1e-9)


def test_dpo_and_a_reward_model_train_under_bf16_master(tiny_model_dir, tmp_path):
    """DPO scores its reference in the weights it trains (bf16): the log-ratios start at exactly 0."""
    data = {
        "train_path": rankings_file(tmp_path / "train.jsonl", 8),
        "eval_path": rankings_file(tmp_path / "eval.jsonl", 4),
    }
    train = {"epochs": 2, "batch_size": 4, "micro_batch_size": 4, "learning_rate": 3e-3, "precision": "bf16_master"}
    output = {"report_to": [], "progress": False}
    model = {"name": str(tiny_model_dir)}
    result = dpo(
        {
            "model": model,
            "data": data,
            "dpo": {"beta": 0.5},
            "train": train,
            "output": {**output, "dir": str(tmp_path / "dpo")},
        }
    )
    assert result.eval_before["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert result.eval_before["rewards/margins"] == 0.0
    assert result.eval_after["loss"] < result.eval_before["loss"]
    result = train_reward_model(
        {
            "model": model,
            "data": data,
            "train": {**train, "epochs": 4},
            "output": {**output, "dir": str(tmp_path / "rm")},
        }
    )
    assert result.eval_after["loss"] < result.eval_before["loss"]
    weights = load_file(str(result.model_dir / "model.safetensors"))
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())
