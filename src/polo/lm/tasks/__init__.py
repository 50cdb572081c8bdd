"""Tasks: datasets of prompts with reference answers, and the correctness check for each.

Build one by name with ``build_task("arithmetic", seed=1)`` (names in ``TASKS``) or call a
builder directly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from polo.lm.tasks.arithmetic import OPERATIONS, arithmetic_task
from polo.lm.tasks.base import (
    DEFAULT_INSTRUCTION,
    PLAIN_INSTRUCTION,
    Task,
    TaskDataError,
    default_instruction,
    fill_instruction,
    format_prompt,
    read_jsonl,
)
from polo.lm.tasks.code import code_task
from polo.lm.tasks.gsm8k import gsm8k_task
from polo.lm.tasks.jsonl import jsonl_task

TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": arithmetic_task,
    "code": code_task,
    "gsm8k": gsm8k_task,
    "jsonl": jsonl_task,
}


def build_task(name: str, **options: object) -> Task:
    """Return the task built by the registered builder ``name`` with ``options``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    builder = TASKS[name]
    accepted = list(inspect.signature(builder).parameters)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        # Checked here so a config typo names the task and its real options, not a bare TypeError.
        raise TypeError(f"task {name!r} has no options {unknown}; accepted options: {accepted}")
    return builder(**options)


__all__ = [
    "DEFAULT_INSTRUCTION",
    "OPERATIONS",
    "PLAIN_INSTRUCTION",
    "TASKS",
    "Task",
    "TaskDataError",
    "arithmetic_task",
    "build_task",
    "code_task",
    "default_instruction",
    "fill_instruction",
    "format_prompt",
    "gsm8k_task",
    "jsonl_task",
    "read_jsonl",
]
