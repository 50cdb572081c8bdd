"""Any user dataset in jsonl form: one JSON object per line with a prompt and an answer field."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

from polo.core.registry import register_task
from polo.data.base import Task, TaskDataError, read_jsonl, task_from_files, text_field

# Imported under another name: jsonl_task's ``checker`` parameter would shadow it.
from polo.rewards.answers import CHECKERS, parse_number
from polo.rewards.answers import checker as bind_checker


def task_row(row: dict, prompt_field: str, answer_field: str, path: str | Path, line: int, unit: str = "line") -> dict:
    """Return a task row with the prompt and answer fields renamed to "question" and "answer".

    The one row contract of user data, from a jsonl file (`read_task_jsonl`) or a Hugging Face
    dataset (`polo.data.hf`): the prompt is a non-empty string, the answer a non-empty string or
    a number (made a string). A row that breaks it is a TaskDataError naming ``path``, the line
    (``unit`` "line") or row index (``unit`` "row") and the field. Other fields are kept as they
    are (a field literally called "question" or "answer" that is not the configured one is
    overwritten by the renamed field).
    """
    if not isinstance(row, Mapping):
        raise TaskDataError(path, line, f"expected a mapping of field names to values, got {type(row).__name__}", unit)
    row = dict(row)
    question = text_field(row, prompt_field, path, line, unit=unit)
    answer = text_field(row, answer_field, path, line, allow_numbers=True, unit=unit)
    for field, value in ((prompt_field, question), (answer_field, answer)):
        if not value.strip():
            raise TaskDataError(path, line, f"field {field!r} is empty", unit)
    kept = {key: value for key, value in row.items() if key not in (prompt_field, answer_field)}
    return {**kept, "question": question, "answer": answer}


def task_rows(
    numbered_rows: Iterable[tuple[int, Mapping]],
    prompt_field: str,
    answer_field: str,
    checker_name: str,
    path: str | Path,
    unit: str = "line",
) -> list[dict]:
    """Return the task rows of ``(line or row index, raw row)`` pairs, each through `task_row`, checked for the
    checker."""
    rows = [(line, task_row(row, prompt_field, answer_field, path, line, unit)) for line, row in numbered_rows]
    # Fail at load time, naming the line, rather than mid-training inside a reward.
    if checker_name == "exact_number":
        for line, row in rows:
            if parse_number(row["answer"]) is None:
                raise TaskDataError(
                    path,
                    line,
                    f"answer {row['answer']!r} is not a number, which checker 'exact_number' needs; "
                    "use checker 'math_verify' or 'exact_string'",
                    unit,
                )
    return [row for _, row in rows]


def read_task_jsonl(path: str | Path, prompt_field: str, answer_field: str, checker_name: str) -> list[dict]:
    """Return the task rows of one user jsonl file, validated for the chosen checker."""
    return task_rows(read_jsonl(path), prompt_field, answer_field, checker_name, path)


@register_task("jsonl", help="your jsonl files")
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

    ``checker`` is one of ``CHECKERS`` (each registered with what it
    accepts); "math_verify" by default.
    """
    correctness = bind_checker(checker, answer_in_tags)  # validates the name before any I/O
    return task_from_files(
        "jsonl",
        functools.partial(read_task_jsonl, prompt_field=prompt_field, answer_field=answer_field, checker_name=checker),
        train_path,
        eval_path,
        num_train=num_train,
        num_eval=num_eval,
        correctness=correctness,
        answer_in_tags=answer_in_tags,
    )


__all__ = ["CHECKERS", "jsonl_task", "read_task_jsonl", "task_row", "task_rows"]
