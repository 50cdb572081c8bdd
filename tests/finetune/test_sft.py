"""SFT: the loss sees response tokens only, and `polo sft` trains, logs and saves a loadable model."""

from __future__ import annotations

import json

import pytest
import torch

from polo.cli import main
from polo.config import ConfigError
from polo.data.preferences import Demonstration
from polo.finetune.fit import Example, collate, encode, sequence_logprobs
from polo.finetune.sft import SFTObjective, encode_demonstrations, load_sft_config, sft
from polo.generation.grouped import GroupSampling, sample_groups
from polo.generation.prompts import render_prompt
from polo.models.loading import load_policy

USER = ({"role": "user", "content": "What is 2 + 3?"},)


def demos_file(path, count: int = 8) -> str:
    rows = [{"prompt": f"What is {i} + 1?", "response": f"{i} + 1 = {i + 1}"} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def tiny_recipe(model_dir, tmp_path, **sections) -> dict:
    recipe = {
        "model": {"name": str(model_dir)},
        "data": {
            "train_path": demos_file(tmp_path / "train.jsonl"),
            "eval_path": demos_file(tmp_path / "eval.jsonl", 4),
        },
        "train": {"epochs": 3, "batch_size": 4, "micro_batch_size": 3, "learning_rate": 3e-3, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "run"), "report_to": [], "progress": False},
    }
    for name, values in sections.items():
        recipe[name] = {**recipe.get(name, {}), **values}
    return recipe


def test_prompt_tokens_are_labelled_minus_100_and_eos_is_learned(tiny_model_dir):
    _, tokenizer = load_policy(str(tiny_model_dir))
    examples = encode_demonstrations(tokenizer, [Demonstration(USER, "5"), Demonstration(USER, "2 + 3 = 5")], None, 512)
    batch = collate([example.sequences[0] for example in examples], tokenizer.pad_token_id)
    labels = batch.labels
    prompt_len = batch.prompt_ids.shape[1]
    assert (labels[:, :prompt_len] == -100).all()
    # the short response: "5" then EOS, then padding (−100)
    assert (
        labels[0, prompt_len:].tolist() == [tokenizer.convert_tokens_to_ids("5"), tokenizer.eos_token_id] + [-100] * 8
    )
    assert tokenizer.decode(labels[1, prompt_len:]) == "2 + 3 = 5<|im_end|>"
    assert SFTObjective(tokenizer.pad_token_id).units(examples[1]) == len("2 + 3 = 5") + 1


def test_sft_loss_is_the_token_mean_nll_of_the_responses_only(tiny_model_dir):
    """Our summed loss over tokens equals Hugging Face's loss with −100 on the prompt, and ignores prompt likelihood."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    examples = encode_demonstrations(tokenizer, [Demonstration(USER, "5"), Demonstration(USER, "2 + 3 = 5")], None, 512)
    objective = SFTObjective(tokenizer.pad_token_id)
    loss_sum, stats = objective.loss(model, examples)
    units = sum(objective.units(example) for example in examples)
    reference = 0.0
    for example in examples:  # one sequence at a time, unpadded: HF's own shifted cross-entropy over the labels
        batch = collate(example.sequences, tokenizer.pad_token_id)
        output = model(input_ids=batch.input_ids, labels=batch.labels)
        reference += output.loss.item() * objective.units(example)
    assert stats["loss"] == pytest.approx(loss_sum.item())
    assert loss_sum.item() / units == pytest.approx(reference / units, rel=1e-5)
    # the same value from the summed sequence log-probs: no prompt token takes part
    batch = collate([example.sequences[0] for example in examples], tokenizer.pad_token_id)
    assert -sequence_logprobs(model, batch).sum().item() == pytest.approx(loss_sum.item(), rel=1e-5)
    # with the prompt tokens as targets too, the loss would be a different number
    single = collate(examples[1].sequences, tokenizer.pad_token_id)
    unmasked = model(input_ids=single.input_ids, labels=single.input_ids).loss.item()
    masked = model(input_ids=single.input_ids, labels=single.labels).loss.item()
    assert unmasked != pytest.approx(masked, rel=1e-3)


def test_gradient_reaches_the_model_only_through_response_positions(tiny_model_dir):
    """Changing the ids in padded positions changes neither the loss nor the gradient."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    examples = encode_demonstrations(tokenizer, [Demonstration(USER, "5"), Demonstration(USER, "2 + 3 = 5")], None, 512)
    pad_a, pad_b = tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("x")
    grads = []
    for pad_id in (pad_a, pad_b):
        model.zero_grad()
        loss, _ = SFTObjective(pad_id).loss(model, examples)
        loss.backward()
        grads.append((loss.item(), model.model.embed_tokens.weight.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-7)


def test_long_responses_are_cut_at_max_length(tiny_model_dir):
    _, tokenizer = load_policy(str(tiny_model_dir))
    prompt = "x" * 10
    (encoded,) = encode(tokenizer, [prompt], ["y" * 50], max_length=20)
    assert len(encoded.prompt_ids) == 10 and len(encoded.response_ids) == 10
    with pytest.raises(ValueError, match="raise data.max_length"):
        encode(tokenizer, [prompt], ["y"], max_length=10)


def test_sft_end_to_end_logs_and_saves_a_loadable_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    result = sft(tiny_recipe(tiny_model_dir, tmp_path))
    assert result.steps == 6  # 3 epochs of 8 demonstrations in batches of 4
    assert result.eval_after["loss"] < result.eval_before["loss"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if "loss" in row]
    assert [row["step"] for row in train_rows] == [1, 2, 3, 4, 5, 6]
    assert {"grad_norm", "learning_rate", "epoch", "sequences_per_second"} <= set(train_rows[0])
    assert [row["step"] for row in rows if "eval/loss" in row] == [0, 6]
    reloaded = AutoModelForCausalLM.from_pretrained(str(result.model_dir))
    assert isinstance(reloaded, torch.nn.Module)
    assert (result.model_dir / "tokenizer.json").exists() and (tmp_path / "run" / "config.yaml").exists()
    # the reloaded model gives the same sequence log-probs as the trained one
    _, tokenizer = load_policy(str(result.model_dir))
    example = encode_demonstrations(tokenizer, [Demonstration(USER, "5")], None, 64)[0]
    batch = collate(example.sequences, tokenizer.pad_token_id)
    trained, _ = load_policy(str(result.model_dir))
    torch.testing.assert_close(sequence_logprobs(reloaded, batch), sequence_logprobs(trained, batch))


# Two prompts with different replies: learning them means conditioning on the prompt, not one memorised string.
TWO_DEMONSTRATIONS = [
    {"prompt": "Name the library.", "response": "polo"},
    {"prompt": "Name the game.", "response": "chess"},
]


def greedy_replies(model_dir, rows: list[dict]) -> list[str]:
    """Return the greedy reply of the model in `model_dir` to each row's prompt, rendered as SFT renders it."""
    model, tokenizer = load_policy(str(model_dir))
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": row["prompt"]}], None) for row in rows]
    groups = sample_groups(model, tokenizer, prompts, GroupSampling(max_new_tokens=10, temperature=0.0))
    return [completion.text for (completion,) in groups]


def test_sft_lowers_the_loss_on_its_data_and_greedy_decoding_gives_the_responses(tiny_model_dir, tmp_path):
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in TWO_DEMONSTRATIONS))
    responses = [row["response"] for row in TWO_DEMONSTRATIONS]
    before = greedy_replies(tiny_model_dir, TWO_DEMONSTRATIONS)
    assert not any(reply.startswith(response[0]) for reply, response in zip(before, responses)), before
    threads = torch.get_num_threads()
    try:  # one thread: the tiny model's steps take milliseconds, not the seconds of threads fighting over the cores
        result = sft(
            tiny_recipe(
                tiny_model_dir,
                tmp_path,
                data={"train_path": str(data), "eval_path": str(data)},  # the loss on its own data
                train={
                    "epochs": 40,
                    "batch_size": 2,
                    "micro_batch_size": 2,
                    "learning_rate": 1e-2,
                    "lr_schedule": "constant",
                    "threads": 1,
                },
            )
        )
    finally:
        torch.set_num_threads(threads)
    assert result.steps == 40
    # From about ln(vocabulary) (a uniform guess) to a small fraction of it (measured: 4.60 -> 0.016).
    assert result.eval_before["loss"] > 4.0
    assert result.eval_after["loss"] < 0.05 * result.eval_before["loss"]
    assert greedy_replies(result.model_dir, TWO_DEMONSTRATIONS) == responses


def test_sft_command_and_config_errors(tiny_model_dir, tmp_path, capsys):
    import yaml

    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tiny_model_dir, tmp_path, train={"max_steps": 1})))
    assert main(["sft", str(recipe), "train.epochs=1"]) == 0
    out = capsys.readouterr().out
    assert "held-out loss:" in out and "(1 steps" in out
    with pytest.raises(ConfigError, match="valid keys in data: train_path"):
        load_sft_config(str(recipe), ["data.trian_path=x.jsonl"])
    with pytest.raises(ConfigError, match="data.train_path is required"):
        load_sft_config({})
    with pytest.raises(ConfigError, match="train.lr_schedule"):
        load_sft_config(str(recipe), ["train.lr_schedule=step"])
    assert main(["sft", str(recipe), "train.batch_size=0"]) == 2
    assert "train.batch_size must be at least 1" in capsys.readouterr().err


def test_sft_reads_chat_messages(tiny_model_dir, tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"{i}?"},
                {"role": "assistant", "content": str(i)},
            ]
        }
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = sft(
        tiny_recipe(tiny_model_dir, tmp_path, data={"train_path": str(path), "eval_path": None}, train={"epochs": 1})
    )
    assert result.steps == 1 and result.eval_before is None
    # The one step's logged loss is the response-token NLL, under the starting model, of exactly these
    # conversations: the system turn in the prompt, the assistant turn the response. The random starting
    # model is nearly uniform, so another reading differs by little (4e-5 relative without the system
    # turn), but by far more than the tolerance: the same examples give the same number to the last bit.
    model, tokenizer = load_policy(str(tiny_model_dir))
    demonstrations = [Demonstration(tuple(row["messages"][:2]), row["messages"][2]["content"]) for row in rows]
    (logged,) = [row["loss"] for row in result.metrics if "loss" in row]
    assert logged == pytest.approx(token_mean_nll(model, tokenizer, demonstrations), rel=1e-6)
    without_system = [Demonstration(d.messages[1:], d.response) for d in demonstrations]
    assert logged != pytest.approx(token_mean_nll(model, tokenizer, without_system), rel=1e-6)


def token_mean_nll(model, tokenizer, demonstrations: list[Demonstration]) -> float:
    """Return the SFT loss of `demonstrations` as one batch: summed response-token NLL over response tokens."""
    objective = SFTObjective(tokenizer.pad_token_id)
    examples = encode_demonstrations(tokenizer, demonstrations, None, 512)
    with torch.no_grad():
        return objective.loss(model, examples)[0].item() / sum(map(objective.units, examples))


def test_examples_hold_one_sequence_each(tiny_model_dir):
    _, tokenizer = load_policy(str(tiny_model_dir))
    (example,) = encode_demonstrations(tokenizer, [Demonstration(USER, "5")], "You add.", 64)
    assert isinstance(example, Example) and len(example.sequences) == 1
    assert "You add." in tokenizer.decode(example.sequences[0].prompt_ids)
