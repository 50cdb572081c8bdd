"""Tasks: datasets of prompts with reference answers, and the correctness check for each.

Build one by name with ``build_task("arithmetic", seed=1)`` (names in ``TASKS``) or call a
builder directly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from polo.config import Config, ConfigError, TaskConfig
from polo.data.arithmetic import OPERATIONS, arithmetic_task
from polo.data.base import (
    DEFAULT_INSTRUCTION,
    PLAIN_INSTRUCTION,
    Task,
    TaskDataError,
    default_instruction,
    fill_instruction,
    format_prompt,
    read_jsonl,
)
from polo.data.code import code_task
from polo.data.environments import make_environment
from polo.data.gsm8k import gsm8k_task
from polo.data.hf import HfSource, hf_options, hf_task
from polo.data.jsonl import jsonl_task
from polo.rewards.answers import CHECKERS

TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": arithmetic_task,
    "code": code_task,
    "gsm8k": gsm8k_task,
    "hf": hf_task,
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
    "HfSource",
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
    "hf_task",
    "jsonl_task",
    "read_jsonl",
]


# Which TaskConfig fields each built-in task takes.
TASK_OPTIONS = {
    "arithmetic": ("seed", "operators", "min_digits", "max_digits", "num_train", "num_eval", "answer_in_tags"),
    "gsm8k": ("train_path", "eval_path", "num_train", "num_eval", "answer_in_tags"),
    "jsonl": (
        "train_path",
        "eval_path",
        "prompt_field",
        "answer_field",
        "num_train",
        "num_eval",
        "answer_in_tags",
        "checker",
    ),
    "hf": (
        "path",
        "subset",
        "split",
        "eval_split",
        "eval_path",
        "prompt_field",
        "answer_field",
        "num_train",
        "num_eval",
        "answer_in_tags",
        "checker",
    ),
    "code": ("num_train", "num_eval", "seed"),
}


def make_task(config: Config, train_dataset: object = None, eval_dataset: object = None) -> Task:
    """Return the task the config names, built with the options that task understands.

    A setting the task cannot use (an unknown name or checker, a row count the data cannot meet)
    is a `ConfigError` naming the key; this runs before any model loads, so a typo costs nothing.
    ``train_dataset`` / ``eval_dataset`` (a ``datasets.Dataset`` or a list of dicts) make it the
    ``hf`` task over those rows (``task.name`` hf or left at its default, ``task.path`` null).
    """
    task_config = config.task
    if task_config.name not in TASKS:
        raise ConfigError(f"task.name: {task_config.name!r} is not one of {', '.join(TASKS)}")
    passed = {"train_dataset": train_dataset, "eval_dataset": eval_dataset}
    passed = {key: value for key, value in passed.items() if value is not None}
    if passed and task_config.name not in ("hf", TaskConfig.name):
        raise ConfigError(
            f"task.name is {task_config.name!r} but {' and '.join(passed)} was passed; datasets make the hf task "
            "(task.name: hf)"
        )
    name = "hf" if passed else task_config.name
    if name in ("jsonl", "hf") and task_config.checker not in CHECKERS:
        raise ConfigError(
            f"task.checker: {task_config.checker!r} is not one of {', '.join(CHECKERS)} "
            "(`polo train --help` says what each accepts)"
        )
    keys = TASK_OPTIONS.get(name, ())
    options = {key: getattr(task_config, key) for key in keys if getattr(task_config, key) is not None}
    options.update(passed)
    if name == "hf":  # the hf task takes where its rows come from as one HfSource
        options = hf_options(options)
    few_shot = _few_shot_pairs(task_config)
    try:
        task = build_task(name, **options)
    except ValueError as error:
        # Builders check their own settings with a plain ValueError; its subclasses (bad data
        # files, decoding errors) already say what they are and pass through unchanged.
        if type(error) is not ValueError:
            raise
        raise ConfigError(f"task {name}: {error}") from error
    task.few_shot = few_shot
    task.environment = make_environment(config, instruction_for(config, task), few_shot)
    return task


def _few_shot_pairs(task_config) -> tuple[tuple[str, str], ...]:
    """Return `task.few_shot` as `(question, response)` pairs; an empty side is a `ConfigError`."""
    for index, example in enumerate(task_config.few_shot):
        for side in ("question", "response"):
            if not getattr(example, side).strip():
                raise ConfigError(
                    f"task.few_shot[{index}].{side} is empty; each example needs a question and a response"
                )
    return tuple((example.question, example.response) for example in task_config.few_shot)


def instruction_for(config: Config, task: Task | None = None) -> str:
    """Return the prompt instruction template: the configured one, else the task's own, else the form's default."""
    if config.task.instruction is not None:
        return config.task.instruction
    if task is not None and task.instruction:
        return task.instruction
    return DEFAULT_INSTRUCTION if config.task.answer_in_tags else PLAIN_INSTRUCTION
