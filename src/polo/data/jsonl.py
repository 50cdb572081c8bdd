"""Any user dataset in jsonl form: one JSON object per line with a prompt and an answer field."""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from polo.core.registry import register_task
from polo.data.base import Task, TaskDataError, default_instruction, read_jsonl, task_from_files, text_field
from polo.generation.prompts import PROMPT_MESSAGES, QUESTION_PLACEHOLDER, TRL_PROMPT

# Imported under another name: jsonl_task's ``checker`` parameter would shadow it.
from polo.rewards.answers import CHECKERS, parse_number
from polo.rewards.answers import checker as bind_checker

# TRL's dataset columns (its standard and conversational formats): the prompt, and the reference answer its
# accuracy reward reads. They are read when task.prompt_field / task.answer_field are left null and the rows have no
# "question" / "answer".
TRL_PROMPT_FIELD, TRL_ANSWER_FIELD = "prompt", "solution"


def row_fields(columns: Collection[str], prompt_field: str | None, answer_field: str | None) -> tuple[str, str]:
    """Return the (prompt field, answer field) of rows with ``columns``: the ones named, else "question" or TRL's
    "prompt", and "answer" or TRL's "solution" (polo's names where both are present)."""
    if prompt_field is None:
        prompt_field = TRL_PROMPT_FIELD if "question" not in columns and TRL_PROMPT_FIELD in columns else "question"
    if answer_field is None:
        answer_field = TRL_ANSWER_FIELD if "answer" not in columns and TRL_ANSWER_FIELD in columns else "answer"
    return prompt_field, answer_field


def _messages(value: list | tuple, field: str, path: str | Path, line: int, unit: str) -> list[dict]:
    """Return a conversational prompt's messages, each ``{"role": str, "content": str}``, or raise TaskDataError
    naming the first message that is not."""
    if not value:
        raise TaskDataError(path, line, f"field {field!r} is an empty list of messages", unit)
    for index, message in enumerate(value):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise TaskDataError(
                path,
                line,
                f"field {field!r}: message {index} must be a {{role, content}} mapping of strings, got {message!r:.80}",
                unit,
            )
    return [{"role": message["role"], "content": message["content"]} for message in value]


def _prompt(row: dict, field: str, trl: bool, where: tuple[str | Path, int, str]) -> dict:
    """Return the row keys a prompt makes: its text as "question" (a conversation's last message), a conversation's
    messages (`PROMPT_MESSAGES`), and TRL's prompt as it stands (`TRL_PROMPT`, for TRL-form rewards' ``prompts``)."""
    path, line, unit = where
    value = row[field]
    if isinstance(value, (list, tuple)):
        messages = _messages(value, field, path, line, unit)
        prompt = {"question": messages[-1]["content"], PROMPT_MESSAGES: messages}
    elif isinstance(value, str):
        prompt = {"question": value}
    else:
        raise TaskDataError(
            path,
            line,
            f"field {field!r} must be a string or a list of {{role, content}} messages, got "
            f"{type(value).__name__} {value!r:.80}",
            unit,
        )
    if not prompt["question"].strip():
        raise TaskDataError(path, line, f"field {field!r} is empty", unit)
    return {**prompt, TRL_PROMPT: value} if trl else prompt


def task_row(
    row: dict, prompt_field: str | None, answer_field: str | None, path: str | Path, line: int, unit: str = "line"
) -> dict:
    """Return a task row: the prompt as "question" (and its messages, for a conversational prompt), the answer as
    "answer".

    The one row contract of user data, from a jsonl file (`read_task_jsonl`) or a Hugging Face
    dataset (`polo.data.hf`): the prompt is a non-empty string or a list of ``{role, content}``
    messages (TRL's conversational format, sent through the chat template as it stands), the answer
    a non-empty string or a number (made a string). Fields left None are found by `row_fields`. A
    row that breaks it is a TaskDataError naming ``path``, the line (``unit`` "line") or row index
    (``unit`` "row") and the field. Other fields, the answer's own among them, are kept as they are
    (a field literally called "question" or "answer" that is not the configured one is overwritten).
    """
    if not isinstance(row, Mapping):
        raise TaskDataError(path, line, f"expected a mapping of field names to values, got {type(row).__name__}", unit)
    row = dict(row)
    auto_prompt, auto_answer = prompt_field is None, answer_field is None
    prompt_field, answer_field = row_fields(row, prompt_field, answer_field)
    if prompt_field not in row:
        named = f"'question' (or TRL's {TRL_PROMPT_FIELD!r})" if auto_prompt else repr(prompt_field)
        raise TaskDataError(path, line, f"missing field {named}; fields present: {sorted(row)}", unit)
    prompt = _prompt(row, prompt_field, auto_prompt and prompt_field == TRL_PROMPT_FIELD, (path, line, unit))
    if answer_field not in row and auto_answer:
        raise TaskDataError(
            path, line, f"missing field 'answer' (or TRL's {TRL_ANSWER_FIELD!r}); fields present: {sorted(row)}", unit
        )
    answer = text_field(row, answer_field, path, line, allow_numbers=True, unit=unit)
    if not answer.strip():
        raise TaskDataError(path, line, f"field {answer_field!r} is empty", unit)
    kept = {key: value for key, value in row.items() if key != prompt_field}
    return {**kept, **prompt, "answer": answer}


def task_rows(
    numbered_rows: Iterable[tuple[int, Mapping]],
    prompt_field: str | None,
    answer_field: str | None,
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


def prompt_instruction(rows: list[dict], answer_in_tags: bool) -> str:
    """Return the default instruction for ``rows``: a TRL prompt is the whole prompt, used as it stands; a question
    is phrased by the template that matches ``answer_in_tags``."""
    return QUESTION_PLACEHOLDER if rows and TRL_PROMPT in rows[0] else default_instruction(answer_in_tags)


def read_task_jsonl(
    path: str | Path, prompt_field: str | None, answer_field: str | None, checker_name: str
) -> list[dict]:
    """Return the task rows of one user jsonl file, validated for the chosen checker."""
    return task_rows(read_jsonl(path), prompt_field, answer_field, checker_name, path)


@register_task("jsonl", help="your jsonl files")
def jsonl_task(
    train_path: str | Path,
    eval_path: str | Path,
    prompt_field: str | None = None,
    answer_field: str | None = None,
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
    task = task_from_files(
        "jsonl",
        functools.partial(read_task_jsonl, prompt_field=prompt_field, answer_field=answer_field, checker_name=checker),
        train_path,
        eval_path,
        num_train=num_train,
        num_eval=num_eval,
        correctness=correctness,
        answer_in_tags=answer_in_tags,
    )
    task.instruction = prompt_instruction(task.train_rows, answer_in_tags)
    return task


__all__ = ["CHECKERS", "jsonl_task", "prompt_instruction", "read_task_jsonl", "row_fields", "task_row", "task_rows"]
