"""GSM8K grade-school maths word problems, read from the dataset's jsonl files.

The files are the dataset's own `train.jsonl` and `test.jsonl` (rows `{"question", "answer"}`, the
answer ending in `#### <number>`), named by `task.train_path` / `task.eval_path`, else found in the
folder `$POLO_GSM8K_DIR`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from polo.config import ConfigError
from polo.core.registry import register_task
from polo.data.base import Task, TaskDataError, read_jsonl, task_from_files, text_field
from polo.rewards.answers import math_verify_answer

FINAL_ANSWER_MARK = "####"
GSM8K_ENV = "POLO_GSM8K_DIR"  # the folder holding GSM8K's train.jsonl and test.jsonl


def final_answer(solution: str, path: str | Path, line: int) -> str:
    """Return the final answer after the last ``####`` of a GSM8K solution, commas removed."""
    if FINAL_ANSWER_MARK not in solution:
        raise TaskDataError(path, line, f"no {FINAL_ANSWER_MARK!r} final answer in 'answer'")
    # GSM8K writes thousands as "1,000"; references are compared as plain numbers.
    answer = solution.rpartition(FINAL_ANSWER_MARK)[2].strip().replace(",", "")
    if not answer:
        raise TaskDataError(path, line, f"empty final answer after {FINAL_ANSWER_MARK!r} in 'answer'")
    return answer


def gsm8k_row(row: dict, path: str | Path, line: int) -> dict:
    """Return a task row: the question, the final answer, and the worked ``solution``."""
    question = text_field(row, "question", path, line)
    solution = text_field(row, "answer", path, line)
    answer = final_answer(solution, path, line)
    return {**row, "question": question, "answer": answer, "solution": solution}


def read_gsm8k(path: str | Path) -> list[dict]:
    """Return every row of a GSM8K jsonl file as a task row."""
    return [gsm8k_row(row, path, line) for line, row in read_jsonl(path)]


def gsm8k_data_dir(explicit: str | Path | None = None) -> Path:
    """Return the GSM8K folder: `explicit`, else `$POLO_GSM8K_DIR`; `ConfigError` when there is neither."""
    if explicit is None and not os.environ.get(GSM8K_ENV):
        raise ConfigError(
            f"gsm8k: no data: set task.train_path and task.eval_path, or {GSM8K_ENV} to a folder holding "
            "train.jsonl and test.jsonl"
        )
    return Path(explicit if explicit is not None else os.environ[GSM8K_ENV]).expanduser()


@register_task("gsm8k", help="grade-school maths word problems, jsonl files in the GSM8K format (Cobbe et al. 2021)")
def gsm8k_task(
    train_path: str | Path | None = None,
    eval_path: str | Path | None = None,
    num_train: int | None = None,
    num_eval: int | None = None,
    answer_in_tags: bool = False,
) -> Task:
    """Return the GSM8K Task from its train and test jsonl files (first N rows when limited).

    A path left None is that file in `gsm8k_data_dir()`. Correctness compares the final answer with
    math_verify, so "72", "72.00" and "$\\boxed{72}$" all count.
    """
    if train_path is None:
        train_path = gsm8k_data_dir() / "train.jsonl"
    if eval_path is None:
        eval_path = gsm8k_data_dir() / "test.jsonl"
    return task_from_files(
        "gsm8k",
        read_gsm8k,
        train_path,
        eval_path,
        num_train=num_train,
        num_eval=num_eval,
        correctness=functools.partial(math_verify_answer, answer_in_tags=answer_in_tags),
        answer_in_tags=answer_in_tags,
    )
