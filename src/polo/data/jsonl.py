"""Any user dataset in jsonl form: one JSON object per line with a prompt and an answer field."""

from __future__ import annotations

from pathlib import Path

# Imported under another name: jsonl_task's ``checker`` parameter would shadow it.
from polo.rewards.answers import CHECKERS, parse_number
from polo.rewards.answers import checker as bind_checker
from polo.data.base import (
    Task,
    TaskDataError,
    default_instruction,
    first_rows,
    read_jsonl,
    text_field,
)


def jsonl_row(
    row: dict, prompt_field: str, answer_field: str, path: str | Path, line: int
) -> dict:
    """Return a task row with the prompt and answer fields renamed to "question" and "answer".

    Other fields are kept as they are (a field literally called "question" or "answer" that is
    not the configured one is overwritten by the renamed field).
    """
    question = text_field(row, prompt_field, path, line)
    answer = text_field(row, answer_field, path, line, allow_numbers=True)
    kept = {key: value for key, value in row.items() if key not in (prompt_field, answer_field)}
    return {**kept, "question": question, "answer": answer}


def _require_numeric_answers(rows: list[tuple[int, dict]], path: str | Path) -> None:
    """Raise TaskDataError at the first row whose answer is not a plain number."""
    for line, row in rows:
        if parse_number(row["answer"]) is None:
            raise TaskDataError(
                path, line,
                f"answer {row['answer']!r} is not a number, which checker 'exact_number' needs; "
                "use checker 'math_verify' or 'exact_string'",
            )


def read_task_jsonl(
    path: str | Path, prompt_field: str, answer_field: str, checker_name: str
) -> list[dict]:
    """Return the task rows of one user jsonl file, validated for the chosen checker."""
    rows = [
        (line, jsonl_row(row, prompt_field, answer_field, path, line))
        for line, row in read_jsonl(path)
    ]
    # Fail at load time, naming the line, rather than mid-training inside a reward.
    if checker_name == "exact_number":
        _require_numeric_answers(rows, path)
    return [row for _, row in rows]


def jsonl_task(
    train_path: str | Path,
    eval_path: str | Path,
    prompt_field: str = "question",
    answer_field: str = "answer",
    num_train: int | None = None,
    num_eval: int | None = None,
    answer_in_tags: bool = False,
    checker: str = "math_verify",
) -> Task:
    """Return a Task over user jsonl files, judged by the named ``checker``.

    ``checker`` is one of ``CHECKERS``: "math_verify" (maths answers in any notation),
    "exact_number" (numeric equality of the final number) or "exact_string" (case-insensitive
    exact text).
    """
    correctness = bind_checker(checker, answer_in_tags)  # validates the name before any I/O
    return Task(
        name="jsonl",
        train_rows=first_rows(
            read_task_jsonl(train_path, prompt_field, answer_field, checker),
            num_train, f"jsonl train {train_path}", "task.num_train",
        ),
        eval_rows=first_rows(
            read_task_jsonl(eval_path, prompt_field, answer_field, checker),
            num_eval, f"jsonl eval {eval_path}", "task.num_eval",
        ),
        correctness=correctness,
        instruction=default_instruction(answer_in_tags),
    )


__all__ = ["CHECKERS", "jsonl_task", "jsonl_row", "read_task_jsonl"]
