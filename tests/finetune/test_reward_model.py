"""Reward models: training with `polo rm`, and `model:PATH` as a batched reward mixed with rule-based ones."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from polo.cli import main
from polo.data import Task
from polo.data.base import PLAIN_INSTRUCTION
from polo.data.preferences import Ranking
from polo.finetune.fit import collate, encode, sequence_rewards
from polo.finetune.reward_model import encode_rankings, new_reward_model, ranking_metrics, train_reward_model
from polo.models.loading import ModelLoadError, load_tokenizer
from polo.rewards import RewardFunctionError, RewardSet, exact_number
from polo.rewards.reward_model import RewardModelReward, parse_reward_spec
from polo.runtime.device import CPU

ROW = {"question": "What is 2 + 3?", "answer": "5"}


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    """A tiny untrained reward model saved the way `polo rm` saves one (with its statistics)."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    torch.manual_seed(0)
    model = new_reward_model(str(tiny_model_dir), tokenizer)
    directory = tmp_path_factory.mktemp("rm")
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    (directory / "reward_stats.json").write_text(json.dumps({"mean": 0.25, "std": 2.0}))
    return directory


def toy_task() -> Task:
    return Task("toy", [ROW], [ROW], functools.partial(exact_number, answer_in_tags=False), PLAIN_INSTRUCTION)


def rl_rows(tokenizer, count: int) -> list[dict]:
    prompt = toy_task().prompts(tokenizer, [ROW])[0]
    return [{"prompt_text": prompt, **ROW} for _ in range(count)]


def test_scores_are_the_same_batched_padded_or_alone(reward_model_dir):
    """The head reads the last real token whatever the padding: batch scores equal one-at-a-time scores."""
    reward = RewardModelReward(reward_model_dir, batch_size=8, compute=CPU)
    completions = ["5", "2 + 3 = 5", "The answer is 6, I think, after a long while."]
    rows = rl_rows(reward.tokenizer, len(completions))
    batched = reward(completions, rows)
    alone = [reward([completion], [row])[0] for completion, row in zip(completions, rows)]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len(set(round(value, 6) for value in batched)) == 3
    # and equal to a plain Hugging Face forward of the unpadded text, prompt + completion + EOS
    ids = reward.tokenizer(rows[2]["prompt_text"] + completions[2], add_special_tokens=False)["input_ids"] + [
        reward.tokenizer.eos_token_id
    ]
    direct = reward.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert batched[2] == pytest.approx(direct, abs=1e-5)


def test_training_and_scoring_see_the_same_tokens(reward_model_dir):
    """A completion scored in RL gets the score its (prompt, response) pair gets in reward-model training."""
    reward = RewardModelReward(reward_model_dir, compute=CPU)
    (example,) = encode_rankings(
        reward.tokenizer,
        [Ranking(({"role": "user", "content": PLAIN_INSTRUCTION.replace("{question}", ROW["question"])},), ("5", "6"))],
        None,
        512,
    )
    trained_view = sequence_rewards(reward.model, collate(example.sequences, reward.pad_id)).tolist()
    assert reward(["5", "6"], rl_rows(reward.tokenizer, 2)) == pytest.approx(trained_view, abs=1e-5)
    # a row without prompt_text rebuilds the same prompt from the question and the task's instruction
    assert reward(["5", "6"], [ROW, ROW]) == pytest.approx(trained_view, abs=1e-5)


def test_model_reward_mixes_with_a_rule_based_reward_by_weight(reward_model_dir):
    spec = f"model:{reward_model_dir}"
    reward_set = RewardSet({spec: 0.5, "correct": 2.0}, toy_task())
    assert reward_set.names == ["rm", "correct"]
    completions = ["2 + 3 = 5", "2 + 3 = 6", "5"]
    rows = rl_rows(reward_set._functions["rm"].tokenizer, 3)
    total, columns = reward_set.score(completions, rows)
    raw = RewardModelReward(reward_model_dir)(completions, rows)
    torch.testing.assert_close(columns["rm"], torch.tensor(raw))
    torch.testing.assert_close(columns["correct"], torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(total, 0.5 * torch.tensor(raw) + 2.0 * torch.tensor([1.0, 0.0, 1.0]))


def test_two_reward_models_get_their_own_columns(reward_model_dir):
    reward_set = RewardSet(
        {f"model:{reward_model_dir}": 1.0, f"model:{reward_model_dir}?normalize": 0.5, "correct": 0.0}, toy_task()
    )
    assert reward_set.names == ["rm", "rm2", "correct"]
    rows = rl_rows(load_tokenizer(str(reward_model_dir)), 2)
    columns = reward_set.score(["5", "7"], rows)[1]
    torch.testing.assert_close(columns["rm2"], (columns["rm"] - 0.25) / 2.0)


def test_normalize_uses_the_saved_statistics(reward_model_dir):
    rows = rl_rows(load_tokenizer(str(reward_model_dir)), 2)
    raw = RewardModelReward(reward_model_dir)(["5", "7"], rows)
    normalised = RewardSet({f"model:{reward_model_dir}?normalize": 1.0}, toy_task()).score(["5", "7"], rows)[1]["rm"]
    torch.testing.assert_close(normalised, (torch.tensor(raw) - 0.25) / 2.0)


def test_reward_spec_errors_name_the_problem(reward_model_dir, tmp_path, tiny_model_dir):
    assert parse_reward_spec("model:runs/rm/final?normalize") == (
        parse_reward_spec("model:runs/rm/final")[0],
        {"normalize": True},
    )
    with pytest.raises(ValueError, match="unknown option 'scale'"):
        parse_reward_spec(f"model:{reward_model_dir}?scale")
    with pytest.raises(ModelLoadError, match="train one with `polo rm"):
        RewardSet({f"model:{tmp_path / 'missing'}": 1.0}, toy_task())
    with pytest.raises(ModelLoadError, match="not a reward model"):
        RewardModelReward(tiny_model_dir)
    bare = tmp_path / "bare"
    bare.mkdir()
    for item in reward_model_dir.iterdir():
        if item.name != "reward_stats.json":
            (bare / item.name).write_bytes(item.read_bytes())
    with pytest.raises(FileNotFoundError, match="reward_stats.json not found"):
        RewardModelReward(bare, normalize=True)


def broken_on_second(completions, rows):
    if len(completions) == 1 and completions[0] == "bad":
        raise ValueError("cannot score this one")
    if "bad" in completions:
        raise ValueError("batch contains a bad sample")
    return torch.tensor([float(len(text)) for text in completions])


broken_on_second.batched = True


def test_batched_reward_errors_still_name_the_sample():
    completions, rows = ["ok", "bad", "fine"], [ROW] * 3
    with pytest.raises(RewardFunctionError, match="'broken_on_second' failed on sample 1 .*cannot score this one"):
        RewardSet({broken_on_second: 1.0}, toy_task()).score(completions, rows)
    forgiving = RewardSet({broken_on_second: 1.0}, toy_task(), on_error="zero")
    total, _ = forgiving.score(completions, rows)
    torch.testing.assert_close(total, torch.tensor([2.0, 0.0, 4.0]))
    assert [error.sample_index for error in forgiving.last_errors] == [1]


def test_batched_reward_is_called_once_per_batch_and_checked():
    calls = []

    def counted(completions, rows):
        calls.append(len(completions))
        return [1.0, float("nan"), 0.5][: len(completions)]

    counted.batched = True
    with pytest.raises(RewardFunctionError, match="sample 1 .*non-finite"):
        RewardSet({counted: 1.0}, toy_task()).score(["a", "b", "c"], [ROW] * 3)
    assert calls == [3]

    def short(completions, rows):
        return [1.0]

    short.batched = True
    with pytest.raises(RewardFunctionError, match="'short' failed on sample 1 .*returned 1 values for 2 completions"):
        RewardSet({short: 1.0}, toy_task(), on_error="zero").score(["a", "b"], [ROW] * 2)


def test_ranking_metrics():
    metrics = ranking_metrics([[2.0, 1.0, 0.0], [0.0, 1.0]])
    assert metrics["pair_accuracy"] == pytest.approx(3 / 4)
    assert metrics["margin"] == pytest.approx((1 + 2 + 1 - 1) / 4)
    assert metrics["reward_mean"] == pytest.approx(0.8)


def rankings_file(path, count: int) -> str:
    rows = [{"prompt": f"Say {i}.", "ranked": [f"{i}", f"{i} {i}", f"{i}!!!!!!"]} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rm_end_to_end_learns_saves_and_reloads(tiny_model_dir, tmp_path, capsys):
    import yaml
    from transformers import AutoModelForSequenceClassification

    recipe = {
        "model": {"name": str(tiny_model_dir)},
        "data": {
            "train_path": rankings_file(tmp_path / "train.jsonl", 8),
            "eval_path": rankings_file(tmp_path / "eval.jsonl", 4),
        },
        "train": {"epochs": 6, "batch_size": 4, "micro_batch_size": 6, "learning_rate": 3e-3, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "rm"), "report_to": [], "progress": False},
    }
    result = train_reward_model(recipe)
    assert result.steps == 12
    assert result.eval_after["pair_accuracy"] == 1.0 and result.eval_after["loss"] < result.eval_before["loss"]
    rows = [row for row in result.metrics if "loss" in row]
    assert {"accuracy", "margin", "reward/chosen", "reward/rejected"} <= set(rows[0])
    reloaded = AutoModelForSequenceClassification.from_pretrained(str(result.model_dir))
    assert reloaded.config.num_labels == 1 and reloaded.config.pad_token_id is not None
    stats = json.loads((result.model_dir / "reward_stats.json").read_text())
    assert stats["num_responses"] == 12 and stats["std"] > 0
    # the saved model ranks held-out responses as it did at the end of training
    reward = RewardModelReward(result.model_dir, compute=CPU)
    tokenizer = reward.tokenizer
    prompt = toy_task().prompts(tokenizer, [{"question": "Say 1."}], "{question}")[0]
    scores = reward(["1", "1 1", "1!!!!!!"], [{"prompt_text": prompt}] * 3)
    assert scores[0] > scores[1] > scores[2]
    # and the command prints the held-out accuracy
    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["rm", str(path), "train.max_steps=1", f"output.dir={tmp_path / 'rm2'}"]) == 0
    assert "held-out pair accuracy:" in capsys.readouterr().out


def test_encode_rankings_keeps_rankings_whole(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    examples = encode_rankings(
        tokenizer,
        [
            Ranking(({"role": "user", "content": "q"},), ("a", "b", "c")),
            Ranking(({"role": "user", "content": "r"},), ("x", "y")),
        ],
        None,
        64,
    )
    assert [len(example.sequences) for example in examples] == [3, 2]
    assert tokenizer.decode(examples[1].sequences[0].response_ids) == "x<|im_end|>"
    assert encode(tokenizer, ["p"], ["x"], 64)[0] == examples[1].sequences[0].__class__(
        tuple(tokenizer("p", add_special_tokens=False)["input_ids"]), examples[1].sequences[0].response_ids
    )


def test_rl_trains_against_a_reward_model(tiny_model_dir, reward_model_dir, tmp_path):
    """`polo train` with a `model:PATH` reward (and the checker logged at weight 0) runs and logs both columns."""
    from polo.rl.train import train

    config = {
        "model": {"name": str(tiny_model_dir)},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 20, "num_eval": 4},
        "rewards": {f"model:{reward_model_dir}?normalize": 1.0, "correct": 0.0},
        "sampling": {"max_new_tokens": 6},
        "algorithm": {"group_size": 2},
        "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "learning_rate": 1e-3, "precision": "fp32"},
        "eval": {"before": False, "after": False},
        "output": {"dir": str(tmp_path / "rl"), "progress": False, "report_to": [], "plots": False},
    }
    result = train(config)
    (row,) = [row for row in result.metrics if "reward/rm/mean" in row]
    assert "reward/correct/mean" in row and row["reward/mean"] == pytest.approx(row["reward/rm/mean"], abs=1e-5)


def test_running_each_prompt_once_gives_the_same_rewards(reward_model_dir):
    from polo.finetune.fit import collate_rankings, ranking_rewards

    reward = RewardModelReward(reward_model_dir, compute=CPU)
    rankings = [
        Ranking(({"role": "user", "content": "q"},), ("a", "bb b", "c")),
        Ranking(({"role": "user", "content": "a longer prompt"},), ("x", "yy")),
    ]
    batch = collate_rankings(encode_rankings(reward.tokenizer, rankings, None, 128), reward.pad_id)
    torch.testing.assert_close(
        ranking_rewards(reward.model, batch), sequence_rewards(reward.model, batch.expanded()), rtol=1e-5, atol=1e-5
    )


def test_polo_eval_scores_every_sample_with_the_reward_model(tiny_model_dir, reward_model_dir, tmp_path, capsys):
    output = tmp_path / "eval.json"
    status = main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--task",
            "arith",
            "--samples",
            "3",
            "--limit",
            "2",
            "--max-new-tokens",
            "4",
            "--reward-model",
            f"{reward_model_dir}?normalize",
            "--output",
            str(output),
            "--no-progress",
        ]
    )
    assert status == 0
    assert "reward model score, mean (correct / wrong samples)" in capsys.readouterr().out
    result = json.loads(output.read_text())
    reward = RewardModelReward(reward_model_dir, normalize=True)
    samples = [sample for problem in result["problems"] for sample in problem["samples"]]
    expected = [
        value
        for problem in result["problems"]
        for value in reward([s["completion"] for s in problem["samples"]], [{"prompt_text": problem["prompt"]}] * 3)
    ]
    assert [sample["reward_model"] for sample in samples] == pytest.approx(expected, abs=1e-5)
    assert result["summary"]["reward_model_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)


def test_polo_eval_refuses_a_missing_reward_model_before_sampling(tiny_model_dir, tmp_path, capsys):
    args = ["eval", "--model", str(tiny_model_dir), "--reward-model", str(tmp_path / "nope")]
    assert main([*args, "--output", str(tmp_path / "e.json")]) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


def test_rm_continues_from_a_saved_reward_model_with_its_head(reward_model_dir, tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    saved = RewardModelReward(reward_model_dir, compute=CPU)
    continued = new_reward_model(str(reward_model_dir), tokenizer)
    for name, tensor in saved.model.state_dict().items():  # trunk and head as saved, nothing re-initialised
        assert torch.equal(continued.state_dict()[name], tensor), name
    two_labels = tmp_path / "classifier"
    shutil.copytree(reward_model_dir, two_labels)
    config = json.loads((two_labels / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (two_labels / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="2 outputs; a reward model has one"):
        new_reward_model(str(two_labels), tokenizer)
