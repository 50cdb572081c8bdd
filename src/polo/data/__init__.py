"""Tasks: datasets of prompts with reference answers, and the correctness check for each.

Every task is registered in ``TASKS`` (`polo.core.registry`) where its builder is defined
(``@register_task("arithmetic")``); a recipe names one by ``task.name``, or a user's own as
``module:Name`` (a `Task` subclass or a function returning a `Task`). Build one by name with
``build_task("arithmetic", seed=1)`` or call a builder directly.
"""

from __future__ import annotations

import dataclasses

from polo.config import Config, ConfigError, TaskConfig
from polo.config.validation import keyword_parameters, task_arguments
from polo.core.registry import TASKS, register_task
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
from polo.data.hf import HfSource, hf_task
from polo.data.jsonl import jsonl_task


def build_task(name: str, **options: object) -> Task:
    """Return the task built by the registered builder ``name`` with ``options``."""
    if name not in TASKS:
        raise ValueError(TASKS.unknown(name))
    builder = TASKS[name]
    accepted = keyword_parameters(builder)
    unknown = sorted(set(options) - set(accepted)) if accepted is not None else []
    if unknown:
        # Checked here so a typo names the task and its real options, not a bare TypeError.
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
    "register_task",
]


def make_task(config: Config, train_dataset: object = None, eval_dataset: object = None) -> Task:
    """Return the task the config names, its builder given the `task` keys and options it takes.

    A setting the task cannot use (an unknown name, a key it needs left unset, a row count the data
    cannot meet) is a `ConfigError` naming the key; this runs before any model loads, so a typo costs
    nothing. ``train_dataset`` / ``eval_dataset`` (a ``datasets.Dataset`` or a list of dicts) make it
    the ``hf`` task over those rows (``task.name`` hf or left at its default, ``task.path`` null).
    """
    task_config = config.task
    passed = {"train_dataset": train_dataset, "eval_dataset": eval_dataset}
    passed = {key: value for key, value in passed.items() if value is not None}
    if passed and task_config.name not in ("hf", TaskConfig.name):
        raise ConfigError(
            f"task.name is {task_config.name!r} but {' and '.join(passed)} was passed; datasets make the hf task "
            "(task.name: hf)"
        )
    if passed:
        task_config = dataclasses.replace(task_config, name="hf")
    entry, arguments = task_arguments(task_config, passed)
    few_shot = _few_shot_pairs(task_config)
    try:
        task = entry.value(**arguments)
    except ValueError as error:
        # Builders check their own settings with a plain ValueError; its subclasses (bad data
        # files, decoding errors) already say what they are and pass through unchanged.
        if type(error) is not ValueError:
            raise
        raise ConfigError(f"task {task_config.name}: {error}") from error
    if not isinstance(task, Task):
        raise ConfigError(f"task.name: {task_config.name} returned a {type(task).__name__}, not a polo.data.Task")
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
