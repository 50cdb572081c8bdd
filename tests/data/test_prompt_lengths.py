"""Prompts longer than the model's context allows are refused at load in one line, or cut with a warning."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import polo
from polo.data import Task
from polo.data.base import TaskDataError
from polo.data.prompt_lengths import PromptRoom, fit_prompts
from polo.generation.prompts import PROMPT_MESSAGES
from polo.models.family import encode_prompts
from polo.rewards import exact_number

sys.path.insert(0, str(Path(__file__).parents[1] / "rl"))
from test_trainer import tiny_config

ROOM = PromptRoom(context=100, train_budget=("sampling.max_new_tokens", 8), eval_budget=("eval.max_new_tokens", 20))
LONG = "x" * 150 + " What is 2 + 2?"  # the tiny tokenizer has a token per character


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def make_task(train, evaluation) -> Task:
    return Task("toy", train, evaluation, exact_number, "{question}", sources=("train.jsonl", "test.jsonl"))


def prompt_length(task, tokenizer, row) -> int:
    return len(encode_prompts(tokenizer, task.prompts(tokenizer, [row]))[0])


def test_a_prompt_that_leaves_no_room_is_refused_naming_source_row_length_and_context(tokenizer):
    short = {"question": "What is 1 + 1?", "answer": "2"}
    task = make_task([short], [short, {"question": LONG, "answer": "4"}, {"question": LONG, "answer": "4"}])
    assert fit_prompts(make_task([short], [short]), tokenizer, ROOM, truncate=False) == []
    length = prompt_length(task, tokenizer, task.eval_rows[1])
    with pytest.raises(TaskDataError) as error:
        fit_prompts(task, tokenizer, ROOM, truncate=False)
    assert str(error.value) == (
        f"test.jsonl row 1: its prompt is {length} tokens, and with eval.max_new_tokens 20 it does not fit the model's "
        "context of 100 tokens (1 more rows of it are too long too); shorten or drop it, or set "
        "task.truncate_prompts=true"
    )


@pytest.mark.parametrize("conversational", [False, True])
def test_truncation_cuts_the_start_of_the_question_to_fit_and_warns(tokenizer, conversational):
    row = {"question": LONG, "answer": "4"}
    if conversational:
        row[PROMPT_MESSAGES] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}]
    task = make_task([row], [])
    warnings = fit_prompts(task, tokenizer, ROOM, truncate=True)
    fitted = task.train_rows[0]
    assert 100 - 8 - 2 <= prompt_length(task, tokenizer, fitted) <= 100 - 8
    assert fitted["question"].endswith(" What is 2 + 2?") and LONG.endswith(fitted["question"])
    if conversational:
        assert fitted[PROMPT_MESSAGES][0]["content"] == "Be brief."
        assert fitted[PROMPT_MESSAGES][-1]["content"] == fitted["question"]
    assert len(warnings) == 1 and warnings[0].startswith("polo: warning: train.jsonl: 1 prompt(s) cut from their start")


def test_a_template_too_long_for_any_question_is_refused_even_when_truncating(tokenizer):
    task = make_task([{"question": "q", "answer": "1"}], [])
    room = PromptRoom(context=12, train_budget=("sampling.max_new_tokens", 8), eval_budget=("eval.max_new_tokens", 8))
    with pytest.raises(TaskDataError, match=r"^train\.jsonl row 0: .*even with its question cut away$"):
        fit_prompts(task, tokenizer, room, truncate=True)


def test_polo_train_refuses_a_held_out_prompt_past_the_context_before_sampling(tiny_model_dir, tmp_path):
    rows = [{"question": f"What is {a} + 1?", "answer": a + 1} for a in range(4)]
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    test.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"question": "y" * 600, "answer": 1}) + "\n")
    config = tiny_config(tiny_model_dir, tmp_path / "run")
    config["task"] = {"name": "jsonl", "train_path": str(train), "eval_path": str(test), "num_eval": None}
    with pytest.raises(TaskDataError, match=rf"^{test} row 1: its prompt is \d+ tokens, .*context of 512 tokens"):
        polo.train(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
