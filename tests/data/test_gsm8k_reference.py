"""GSM8K's own reference solutions, used as completions, must score 100%; shuffled, almost nothing.

This checks the whole scoring path of `polo eval` on GSM8K (answer after ####, thousands
separators, math_verify comparison, answer keys and the vote) without a model.
"""

from __future__ import annotations

import random

import pytest

from polo.config import ConfigError
from polo.data import gsm8k_task
from polo.data.gsm8k import gsm8k_data_dir
from polo.evaluation.evaluate import answer_key_for, score_problem, summarize
from polo.generation.grouped import Completion
from polo.rewards.answers import exact_number, math_verify_answer

NUM_PROBLEMS = 200


@pytest.fixture(scope="module")
def gsm8k_test_path():
    try:
        path = gsm8k_data_dir() / "test.jsonl"
    except ConfigError as error:  # no $POLO_GSM8K_DIR (tests/conftest.py sets it where the data is)
        pytest.skip(str(error))
    if not path.is_file():
        pytest.skip(f"GSM8K's test file {path} is absent")
    return path


@pytest.fixture(scope="module")
def gsm8k_eval(gsm8k_test_path):
    return gsm8k_task(gsm8k_test_path, gsm8k_test_path, num_train=0, num_eval=NUM_PROBLEMS)


def as_completions(texts: list[str]) -> list[Completion]:
    return [Completion(text=text, length=0, truncated=False) for text in texts]


def test_reference_solutions_score_100_percent(gsm8k_eval):
    rows = gsm8k_eval.eval_rows
    assert len(rows) == NUM_PROBLEMS
    # The set must exercise the thousands-separator path ("#### 2,125").
    assert any("," in row["solution"].rpartition("####")[2] for row in rows)
    scores = [gsm8k_eval.correctness(row["solution"], row) for row in rows]
    assert scores == [1.0] * NUM_PROBLEMS


@pytest.mark.parametrize("checker", [math_verify_answer, exact_number], ids=lambda checker: checker.__name__)
def test_every_reference_solution_in_the_test_file_scores_100_percent(gsm8k_test_path, checker):
    """All 1,319: the final answer after "####" is read even when the working talks of percentages,
    money or "the answer from the previous step" (four of these scored 0 when math_verify read the
    whole solution)."""
    rows = gsm8k_task(gsm8k_test_path, gsm8k_test_path, num_train=0).eval_rows
    wrong = [index for index, row in enumerate(rows) if checker(row["solution"], row) != 1.0]
    assert wrong == []
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    shuffled = sum(checker(rows[other]["solution"], row) for row, other in zip(rows, order))
    assert shuffled / len(rows) < 0.05


def test_shuffled_solutions_score_below_5_percent(gsm8k_eval):
    rows = gsm8k_eval.eval_rows
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    scores = [gsm8k_eval.correctness(rows[other]["solution"], row) for row, other in zip(rows, order)]
    # A few problems share a final answer by chance; 5% is 10 of 200.
    assert sum(scores) / len(scores) < 0.05


def test_reference_solutions_through_the_eval_metrics(gsm8k_eval):
    """Two copies of the reference and one wrong solution per problem: the vote and pass@k agree."""
    rows = gsm8k_eval.eval_rows[:40]
    key = answer_key_for(gsm8k_eval.correctness)
    problems = []
    for index, row in enumerate(rows):
        wrong = rows[(index + 1) % len(rows)]["solution"]
        texts = [wrong, row["solution"], row["solution"]]
        problems.append(score_problem(row, as_completions(texts), gsm8k_eval.correctness, key, [1, 3]))
    # every sample's vote key is the number after its "####"
    for row, problem in zip(rows, problems):
        assert problem["samples"][1]["answer"] == row["answer"]
    summary = summarize(problems)
    assert summary["pass@k"]["3"] == 1.0
    assert summary["cons@k"]["3"] == 1.0  # two references outvote one wrong solution
    assert summary["pass@1"] == pytest.approx(2 / 3, abs=0.03)  # a neighbour may share the answer
