"""Preference data: rankings and their pairs, jsonl rows with file-and-line errors, the built-in arithmetic set."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from polo.cli import main
from polo.data import TaskDataError, arithmetic_task
from polo.data.preferences import (
    Ranking,
    arithmetic_preference_data,
    comparisons_from_samples,
    has_carry,
    ranking_from_row,
    ranking_pairs,
    read_demonstrations,
    read_rankings,
    wrong_answer,
)
from polo.finetune.sampled_preferences import PreferenceDraw, sampled_preference_data
from polo.generation.grouped import GroupSampling
from polo.generation.prompts import render_prompt
from polo.rewards import exact_number


def write_rows(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_a_k_way_ranking_stands_for_all_k_choose_2_pairs():
    ranking = Ranking(({"role": "user", "content": "q"},), ("best", "good", "bad", "worst"))
    assert len(ranking.pairs()) == 4 * 3 // 2
    assert ranking.pairs() == [
        ("best", "good"),
        ("best", "bad"),
        ("best", "worst"),
        ("good", "bad"),
        ("good", "worst"),
        ("bad", "worst"),
    ]
    assert [len(ranking_pairs(k)) for k in (2, 3, 5)] == [1, 3, 10]
    with pytest.raises(ValueError, match="at least 2"):
        ranking_pairs(1)


def test_read_rankings_accepts_pairs_and_rankings(tmp_path):
    path = write_rows(
        tmp_path / "prefs.jsonl",
        [
            {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3", "extra": "ignored"},
            {
                "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
                "ranked": ["4", "5", "22"],
            },
        ],
    )
    first, second = read_rankings(path)
    assert first.responses == ("2", "3") and first.messages == ({"role": "user", "content": "What is 1 + 1?"},)
    assert second.responses == ("4", "5", "22") and second.messages[0]["role"] == "system"
    assert len(read_rankings(path, limit=1)) == 1


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, "missing field 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
        ({"prompt": "q", "ranked": ["only one"]}, "at least 2 strings"),
        ({"prompt": "q", "ranked": ["a", "a"]}, "same response twice"),
        ({"prompt": "q", "chosen": 1, "rejected": "b"}, "'chosen' must be a string"),
        ({"prompt": [{"role": "robot", "content": "hi"}], "chosen": "a", "rejected": "b"}, "prompt\\[0\\] must be"),
        ({"prompt": "q", "answer": "a"}, "needs 'chosen' and 'rejected', or 'ranked'"),
    ],
)
def test_malformed_comparison_rows_name_file_and_line(tmp_path, row, message):
    path = write_rows(tmp_path / "bad.jsonl", [{"prompt": "fine", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(TaskDataError, match=message) as error:
        read_rankings(path)
    assert error.value.line == 2 and error.value.path == path and "bad.jsonl line 2" in str(error.value)


def test_read_demonstrations_accepts_prompt_response_and_chat_messages(tmp_path):
    path = write_rows(
        tmp_path / "sft.jsonl",
        [
            {"prompt": "What is 1 + 1?", "response": "1 + 1 = 2"},
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"},
                ]
            },
        ],
    )
    first, second = read_demonstrations(path)
    assert first.response == "1 + 1 = 2" and first.messages == ({"role": "user", "content": "What is 1 + 1?"},)
    assert second.response == "4" and len(second.messages) == 3 and second.messages[-1]["content"] == "2+2?"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", "invalid JSON"),
        ({"prompt": "q"}, "missing field 'response'"),
        ({"messages": [{"role": "user", "content": "q"}]}, "must end with an assistant message"),
        ({"question": "q", "answer": "a"}, "needs 'prompt' and 'response', or 'messages'"),
    ],
)
def test_malformed_demonstration_rows_name_file_and_line(tmp_path, row, message):
    path = write_rows(tmp_path / "sft.jsonl", [{"prompt": "q", "response": "a"}, row])
    with pytest.raises(TaskDataError, match=message) as error:
        read_demonstrations(path)
    assert "sft.jsonl line 2" in str(error.value)


def test_a_user_prompt_renders_exactly_as_the_rl_trainer_prompts(tiny_model_dir):
    from polo.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    task = arithmetic_task(num_train=10, num_eval=2)
    row = task.train_rows[0]
    rl_prompt = task.prompts(tokenizer, [row], None, "Be exact.")[0]
    user_message = task.instruction.replace("{question}", row["question"])
    assert render_prompt(tokenizer, [{"role": "user", "content": user_message}], "Be exact.") == rl_prompt
    assert rl_prompt.endswith("<|im_start|>assistant\n")


def test_arithmetic_data_avoids_the_rl_held_out_problems_and_matches_the_checker():
    task = arithmetic_task(seed=3, num_train=600, num_eval=50)
    splits = arithmetic_preference_data(
        task,
        seed=1,
        num_sft=100,
        num_sft_eval=20,
        num_comparisons=200,
        num_comparisons_eval=50,
        mistakes=["carry", "tens", "units", "carry"],
    )
    assert {name: len(rows) for name, rows in splits.items()} == {
        "sft_train": 100,
        "sft_eval": 20,
        "preferences_train": 200,
        "preferences_eval": 50,
    }
    held_out = {task.instruction.replace("{question}", row["question"]) for row in task.eval_rows}
    prompts = {name: {row["prompt"] for row in rows} for name, rows in splits.items()}
    assert all(not (found & held_out) for found in prompts.values())
    names = list(prompts)
    assert all(not (prompts[a] & prompts[b]) for i, a in enumerate(names) for b in names[i + 1 :])  # splits disjoint
    for row in splits["preferences_train"] + splits["preferences_eval"]:
        (ranking,) = [ranking_from_row(row, "built-in", 1)]
        assert [exact_number(text, {"answer": row["answer"]}) for text in ranking.responses] == [1.0, 0.0]
        a, b = (int(x) for x in row["chosen"].split(" = ")[0].split(" + "))
        error = int(row["rejected"].split("= ")[1]) - int(row["answer"])
        carry_error = -10 if has_carry(a, b) else 10
        assert error == {"carry": carry_error, "tens": -carry_error}.get(row["mistake"], error) and abs(error) in (
            1,
            10,
        )
        assert (abs(error) == 1) == (row["mistake"] == "units")
        assert row["chosen"].split("= ")[0] == row["rejected"].split("= ")[0]  # same wording
    mistakes = Counter(row["mistake"] for row in splits["preferences_train"])
    assert mistakes == {"carry": 100, "tens": 50, "units": 50}  # cycled problem by problem
    default = arithmetic_preference_data(
        task, seed=1, num_sft=100, num_sft_eval=20, num_comparisons=200, num_comparisons_eval=50
    )
    assert {row["mistake"] for row in default["preferences_train"]} == {"carry"}
    assert [row["prompt"] for row in default["preferences_train"]] == [
        row["prompt"] for row in splits["preferences_train"]
    ]
    with pytest.raises(ValueError, match="mistakes must name at least one of carry, tens, units; got \\['hundreds'\\]"):
        arithmetic_preference_data(task, mistakes=["hundreds"])
    for row in splits["sft_train"]:
        assert exact_number(row["response"], row) == 1.0 and row["prompt"].endswith(
            "end your reply with the final number."
        )


def test_wrong_answers_make_one_kind_of_mistake():
    rng = random.Random(0)
    assert wrong_answer(47, "+", 38, "carry", rng) == 75  # the carry forgotten
    assert wrong_answer(41, "+", 38, "carry", rng) == 89  # a carry that is not there
    assert wrong_answer(47, "+", 38, "tens", rng) == 95 and wrong_answer(41, "+", 38, "tens", rng) == 69
    assert wrong_answer(3, "+", 4, "tens", rng) == 17  # never negative
    assert {wrong_answer(47, "+", 38, "units", rng) for _ in range(20)} == {84, 86}
    assert {wrong_answer(47, "-", 38, "carry", rng) for _ in range(20)} == {19}  # 9 - 10 < 0: only up
    with pytest.raises(ValueError, match="valid: carry, tens, units"):
        wrong_answer(1, "+", 2, "hundreds", rng)


def test_arithmetic_data_asks_for_no_more_problems_than_the_task_has():
    with pytest.raises(ValueError, match="raise task.num_train"):
        arithmetic_preference_data(arithmetic_task(num_train=10, num_eval=5), num_sft=20)


def test_make_preferences_command_writes_the_splits(tmp_path, capsys):
    recipe = tmp_path / "rl.yaml"
    recipe.write_text("task: {name: arithmetic, seed: 2, num_train: 300, num_eval: 20}\n")
    status = main(
        [
            "make-preferences",
            str(tmp_path / "data"),
            "--recipe",
            str(recipe),
            "--num-sft",
            "10",
            "--num-sft-eval",
            "5",
            "--num-comparisons",
            "20",
            "--num-comparisons-eval",
            "5",
            "--mistakes",
            "carry,units",
        ]
    )
    assert status == 0
    assert "preferences_train.jsonl  (20 rows)" in capsys.readouterr().out
    assert len(read_rankings(tmp_path / "data" / "preferences_train.jsonl")) == 20
    rows = [json.loads(line) for line in (tmp_path / "data" / "preferences_train.jsonl").read_text().splitlines()]
    assert [row["mistake"] for row in rows[:4]] == ["carry", "units", "carry", "units"]
    assert len(read_demonstrations(tmp_path / "data" / "sft_eval.jsonl")) == 5
    eval_questions = {row["question"] for row in arithmetic_task(seed=2, num_train=300, num_eval=20).eval_rows}
    written = (tmp_path / "data" / "preferences_eval.jsonl").read_text()
    assert not any(question in written for question in eval_questions)


def test_make_preferences_refuses_an_unknown_mistake(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["make-preferences", str(tmp_path / "data"), "--mistakes", "carry,hundreds"])
    assert stopped.value.code == 2
    assert "give one or more of carry, tens, units" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_comparisons_from_samples_rank_each_right_answer_above_a_wrong_one():
    samples = [("= 85", 1.0), ("= 75", 0.0), ("= 85", 1.0), ("85", 1.0), ("= 95", 0.0), ("= 75", 0.0)]
    rows = comparisons_from_samples("What is 47 + 38?", samples, random.Random(0), max_pairs=10)
    assert sorted((row["chosen"], row["rejected"]) for row in rows) == [
        ("85", "= 75"),
        ("85", "= 95"),
        ("= 85", "= 75"),
        ("= 85", "= 95"),
    ]
    assert all(row["prompt"] == "What is 47 + 38?" for row in rows)
    capped = comparisons_from_samples("q", samples, random.Random(0), max_pairs=3)
    assert len(capped) == 3 and len({(row["chosen"], row["rejected"]) for row in capped}) == 3
    assert comparisons_from_samples("q", [("a", 1.0), ("b", 1.0)], random.Random(0)) == []
    assert comparisons_from_samples("q", [("a", 0.0), ("b", 0.0)], random.Random(0)) == []


def test_sampled_preferences_rank_the_models_own_answers_on_training_problems(tiny_model_dir):
    from polo.models.loading import load_policy

    model, tokenizer = load_policy(str(tiny_model_dir))
    task = arithmetic_task(num_train=60, num_eval=10)
    task.correctness = lambda text, row: float(len(text) % 2 == 0)  # a checker the tiny model passes half the time
    draw = PreferenceDraw(num_prompts=6, num_prompts_eval=2, max_pairs=2, instruction="Add: {question}")
    sampling = GroupSampling(samples=4, max_new_tokens=5)
    splits, stats = sampled_preference_data(model, tokenizer, task, draw, sampling)
    assert stats["preferences_train"] == len(splits["preferences_train"]) <= 12
    assert stats["preferences_eval"] == len(splits["preferences_eval"]) <= 4
    rows = splits["preferences_train"] + splits["preferences_eval"]
    assert rows and stats["prompts_with_a_comparison"] >= 1
    assert all(len(row["chosen"]) % 2 == 0 and len(row["rejected"]) % 2 == 1 for row in rows)
    held_out = {row["question"] for row in task.eval_rows}
    assert all(row["prompt"].startswith("Add: ") and row["prompt"][5:] not in held_out for row in rows)
    assert not {row["prompt"] for row in splits["preferences_train"]} & {
        row["prompt"] for row in splits["preferences_eval"]
    }
    with pytest.raises(ValueError, match="training split holds"):
        sampled_preference_data(model, tokenizer, task, PreferenceDraw(num_prompts=100), sampling)


def test_sampled_comparisons_keep_the_few_shot_turns_they_were_sampled_with(tiny_model_dir):
    from polo.models.loading import load_policy

    model, tokenizer = load_policy(str(tiny_model_dir))
    task = arithmetic_task(num_train=20, num_eval=4)
    task.few_shot = (("What is 1 + 1?", "2"),)
    task.correctness = lambda text, row: float(len(text) % 2 == 0)
    draw = PreferenceDraw(num_prompts=6, num_prompts_eval=0, instruction="{question}")
    splits, _ = sampled_preference_data(model, tokenizer, task, draw, GroupSampling(samples=4, max_new_tokens=5))
    rows = splits["preferences_train"]
    assert rows and all([message["role"] for message in row["prompt"]] == ["user", "assistant", "user"] for row in rows)
    assert all(row["prompt"][1]["content"] == "2" for row in rows)


def test_make_preferences_from_a_model_writes_comparisons_and_stats(tiny_model_dir, tmp_path, capsys):
    recipe = tmp_path / "rl.yaml"
    recipe.write_text("task: {name: arithmetic, num_train: 50, num_eval: 10}\nsampling: {max_new_tokens: 4}\n")
    status = main(
        [
            "make-preferences",
            str(tmp_path / "data"),
            "--recipe",
            str(recipe),
            "--from-model",
            str(tiny_model_dir),
            "--num-prompts",
            "4",
            "--num-prompts-eval",
            "2",
            "--samples",
            "3",
        ]
    )
    assert status == 0
    stats = json.loads((tmp_path / "data" / "sampling.json").read_text())
    assert stats["prompts"] == 6 and stats["samples_per_prompt"] == 3 and stats["model"] == str(tiny_model_dir)
    written = (tmp_path / "data" / "preferences_train.jsonl").read_text().splitlines()
    assert len(written) == stats["preferences_train"]
    assert "of 18 samples correct" in capsys.readouterr().out


def test_make_preferences_from_a_model_refuses_bad_counts_before_loading(tmp_path, capsys):
    recipe = tmp_path / "rl.yaml"
    recipe.write_text("task: {name: arithmetic, num_train: 50, num_eval: 10}\n")
    base = [
        "make-preferences",
        str(tmp_path / "data"),
        "--recipe",
        str(recipe),
        "--from-model",
        str(tmp_path / "no-model"),
    ]
    assert main(base + ["--samples", "1"]) == 2
    assert "samples must be an integer >= 2, got 1" in capsys.readouterr().err
    assert main(base + ["--num-prompts", "100"]) == 2
    assert "training split holds 50" in capsys.readouterr().err
    assert main(base + ["--temperature", "0"]) == 2
    assert "--temperature must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()
