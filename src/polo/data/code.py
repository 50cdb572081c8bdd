"""Short function-writing problems ("Write a Python function `is_palindrome(s)` ..."), judged by
running the completion's code against each problem's tests in the sandbox (``polo.sandbox.runner``).

The problems ship with polo in ``polo/data/problems/code_problems.jsonl``: one JSON object per line with
``question``, ``answer`` (a reference solution), ``entry_point`` (the function's name) and
``tests`` (3-6 ``assert <call> == <literal>`` statements; in general each test is an assert,
optionally after setup statements, judged in the parent as ``polo.rewards.code`` describes).
"""

from __future__ import annotations

import random
from pathlib import Path

from polo.core.registry import register_task
from polo.data.base import Task, TaskDataError, first_rows, read_jsonl, text_field
from polo.rewards.code import all_tests_pass
from polo.rewards.judge import TestFormatError, parse_test

CODE_PROBLEMS_PATH = Path(__file__).parent / "problems" / "code_problems.jsonl"
DEFAULT_NUM_EVAL = 10

CODE_INSTRUCTION = (
    "{question}\n\nReply with the complete function in a single ```python code block, with no example usage."
)


def code_row(row: dict, path: str | Path, line: int) -> dict:
    """Return a validated code-task row, or raise TaskDataError naming file and line."""
    for name in ("question", "answer", "entry_point"):
        text_field(row, name, path, line)
    tests = row.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise TaskDataError(path, line, f"field 'tests' must be a non-empty list of assert statements, got {tests!r}")
    for test in tests:
        try:
            parse_test(test)
        except TestFormatError as exc:
            raise TaskDataError(path, line, f"field 'tests': {exc}") from exc
    return dict(row)


def read_code_problems(path: str | Path = CODE_PROBLEMS_PATH) -> list[dict]:
    """Return every problem of a code-task jsonl file, validated."""
    return [code_row(row, path, line) for line, row in read_jsonl(path)]


@register_task("code", help="programs run against tests in the sandbox")
def code_task(num_train: int | None = None, num_eval: int | None = None, seed: int = 0) -> Task:
    """Return the built-in code Task: disjoint train and eval problems, shuffled by ``seed``.

    Eval takes the first ``num_eval`` problems of the shuffled list (default 10), train the
    rest (the first ``num_train`` of them when given), so the eval split for a seed does not
    depend on ``num_train``. Correctness is 1.0 when the completion passes every test (so is the
    ``code`` reward; ``code_fraction`` gives the fraction passed).
    """
    problems = read_code_problems()
    random.Random(seed).shuffle(problems)
    eval_count = DEFAULT_NUM_EVAL if num_eval is None else num_eval
    if isinstance(eval_count, bool) or not isinstance(eval_count, int) or not 0 <= eval_count < len(problems):
        raise ValueError(
            f"code task: num_eval must be an integer in [0, {len(problems) - 1}] "
            f"(the file holds {len(problems)} problems), got {num_eval!r}"
        )
    return Task(
        name="code",
        train_rows=first_rows(problems[eval_count:], num_train, "code train"),
        eval_rows=problems[:eval_count],
        correctness=all_tests_pass,
        instruction=CODE_INSTRUCTION,
    )


__all__ = ["CODE_INSTRUCTION", "CODE_PROBLEMS_PATH", "code_row", "code_task", "read_code_problems"]
