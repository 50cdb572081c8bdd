"""DPO: sequence log-probs over response tokens, the frozen reference, TRL-style metrics, `polo dpo` end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from polo import core
from polo.cli import main
from polo.config import ConfigError
from polo.data.preferences import Ranking
from polo.finetune.dpo import DPOObjective, dpo, load_dpo_config, with_reference_logps
from polo.finetune.fit import collate, sequence_logprobs
from polo.finetune.reward_model import encode_rankings
from polo.models.loading import load_policy
from polo.runtime.device import CPU

PROMPT = ({"role": "user", "content": "Say 1."},)


def test_sequence_logprobs_sum_the_response_tokens_only(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    (example,) = encode_rankings(tokenizer, [Ranking(PROMPT, ("1", "one, I think"))], None, 64)
    batch = collate(example.sequences, tokenizer.pad_token_id)  # padded: the responses differ in length
    batched = sequence_logprobs(model, batch)
    for row, sequence in enumerate(example.sequences):  # by hand, unpadded: log-softmax at each response position
        ids = torch.tensor([sequence.prompt_ids + sequence.response_ids])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        start = len(sequence.prompt_ids)
        expected = sum(logprobs[start - 1 + t, token].item() for t, token in enumerate(sequence.response_ids))
        assert batched[row].item() == pytest.approx(expected, rel=1e-5)


def test_dpo_starts_at_log_2_with_zero_implicit_rewards(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    examples = encode_rankings(tokenizer, [Ranking(PROMPT, ("1", "2", "3")), Ranking(PROMPT, ("a", "b"))], None, 64)
    examples = with_reference_logps(model, examples, tokenizer.pad_token_id, micro_batch_size=2, compute=CPU)
    assert all(len(example.reference_logps) == len(example.sequences) for example in examples)
    objective = DPOObjective(tokenizer.pad_token_id, beta=0.1)
    assert [objective.units(example) for example in examples] == [3, 1]
    loss_sum, stats = objective.loss(model, examples)
    assert loss_sum.item() / 4 == pytest.approx(math.log(2), abs=1e-5)
    assert stats["rewards/chosen"] == pytest.approx(0.0, abs=1e-5) and stats["rewards/margins"] == pytest.approx(
        0.0, abs=1e-5
    )


def test_dpo_objective_matches_the_core_loss_on_shifted_log_probs(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    (example,) = encode_rankings(tokenizer, [Ranking(PROMPT, ("1", "2", "3"))], None, 64)
    example = example.__class__(example.sequences, (-1.0, -2.0, -4.0))  # a made-up reference
    loss_sum, stats = DPOObjective(tokenizer.pad_token_id, beta=0.5).loss(model, [example])
    logps = sequence_logprobs(model, collate(example.sequences, tokenizer.pad_token_id))
    reference = torch.tensor(example.reference_logps)
    better, worse = torch.tensor([0, 0, 1]), torch.tensor([1, 2, 2])
    expected, chosen, rejected = core.dpo_loss(logps[better], logps[worse], reference[better], reference[worse], 0.5)
    assert loss_sum.item() == pytest.approx(expected.sum().item(), rel=1e-5)
    assert stats["rewards/accuracies"] == float((chosen > rejected).sum())
    assert stats["logps/chosen"] == pytest.approx(logps[better].sum().item(), rel=1e-5)


def rankings_file(path, count: int) -> str:
    rows = [{"prompt": f"Say {i}.", "chosen": f"{i}", "rejected": f"{i}{i}{i} no"} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_dpo_end_to_end_logs_trl_metrics_and_saves_a_loadable_model(tiny_model_dir, tmp_path, capsys):
    import yaml
    from transformers import AutoModelForCausalLM

    recipe = {
        "model": {"name": str(tiny_model_dir)},
        "data": {
            "train_path": rankings_file(tmp_path / "train.jsonl", 8),
            "eval_path": rankings_file(tmp_path / "eval.jsonl", 4),
        },
        "dpo": {"beta": 0.5},
        "train": {"epochs": 3, "batch_size": 4, "micro_batch_size": 4, "learning_rate": 3e-3, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "dpo"), "report_to": [], "progress": False},
    }
    result = dpo(recipe)
    assert result.steps == 6
    rows = [row for row in result.metrics if "loss" in row]
    assert {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    } <= set(rows[0])
    assert result.eval_before["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert result.eval_after["rewards/margins"] > 0 and result.eval_after["loss"] < result.eval_before["loss"]
    assert rows[-1]["rewards/accuracies"] == 1.0
    reloaded = AutoModelForCausalLM.from_pretrained(str(result.model_dir))
    assert isinstance(reloaded, torch.nn.Module)
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["dpo", str(path), "train.max_steps=1", f"output.dir={tmp_path / 'dpo2'}"]) == 0
    assert "held-out preference accuracy (implicit reward):" in capsys.readouterr().out


def test_dpo_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"dpo.beta must be a finite number > 0, got 0.0"):
        load_dpo_config({"data": {"train_path": "x.jsonl"}, "dpo": {"beta": 0}})
    with pytest.raises(ConfigError, match="valid keys in dpo: beta"):
        load_dpo_config({"data": {"train_path": "x.jsonl"}, "dpo": {"bta": 0.1}})


def test_running_each_prompt_once_gives_the_same_log_probs_and_gradients(tiny_model_dir):
    from polo.finetune.fit import collate_rankings, ranking_logprobs

    model, tokenizer = load_policy(str(tiny_model_dir))
    rankings = [
        Ranking(PROMPT, ("1", "one, I think so", "111")),
        Ranking(({"role": "user", "content": "A longer prompt here?"},), ("x", "yy")),
    ]
    batch = collate_rankings(encode_rankings(tokenizer, rankings, None, 128), tokenizer.pad_token_id)
    assert (
        batch.prompt_ids.shape[0] == 2 and batch.response_ids.shape[0] == 5 and batch.owner.tolist() == [0, 0, 0, 1, 1]
    )
    results = []
    for compute in (lambda: ranking_logprobs(model, batch), lambda: sequence_logprobs(model, batch.expanded())):
        model.zero_grad()
        values = compute()
        values.sum().backward()
        results.append((values.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-6)


def test_nll_weight_adds_the_preferred_answers_per_token_nll(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    (example,) = encode_rankings(tokenizer, [Ranking(PROMPT, ("1", "22"))], None, 64)
    example = example.__class__(example.sequences, (-1.0, -2.0))
    plain, _ = DPOObjective(tokenizer.pad_token_id, beta=0.5).loss(model, [example])
    mixed, stats = DPOObjective(tokenizer.pad_token_id, beta=0.5, nll_weight=0.2).loss(model, [example])
    chosen_logp = sequence_logprobs(model, collate(example.sequences[:1], tokenizer.pad_token_id))[0]
    chosen_tokens = len(example.sequences[0].response_ids)  # "1" and EOS
    assert stats["nll/chosen"] == pytest.approx(-chosen_logp.item() / chosen_tokens, rel=1e-5)
    assert mixed.item() == pytest.approx(plain.item() + 0.2 * stats["nll/chosen"], rel=1e-5)
    with pytest.raises(ConfigError, match=r"dpo.nll_weight must be a finite number >= 0, got -1.0"):
        load_dpo_config({"data": {"train_path": "x.jsonl"}, "dpo": {"nll_weight": -1}})
