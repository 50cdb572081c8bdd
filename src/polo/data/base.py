"""The task abstraction: rows of problems, how to prompt for them, and what counts as correct.

A *row* is a plain ``dict`` with at least ``"question"`` (the problem text shown to the model)
and ``"answer"`` (the reference final answer, a string), plus any other fields a builder or a
user reward function wants to keep (GSM8K keeps the worked ``"solution"``, arithmetic keeps the
operands). Reward functions receive the whole row, so extra fields are how task-specific
information reaches them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polo.config.schema import ConfigError
from polo.generation.prompts import (  # noqa: F401  (re-exported: tasks own their prompts)
    DEFAULT_INSTRUCTION,
    PLAIN_INSTRUCTION,
    PROMPT_MESSAGES,
    QUESTION_PLACEHOLDER,
    default_instruction,
    fill_instruction,
    format_prompt,
    render_messages,
    render_prompt,
)


class TaskDataError(ValueError):
    """A task data file holds a row that cannot be used; the message names file and line.

    ``unit`` names what ``line`` counts: a file's 1-based "line", or a dataset's 0-based "row"
    (``dataset[row]``), where ``path`` names the dataset and split.
    """

    def __init__(self, path: str | Path, line: int | None, problem: str, unit: str = "line") -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        self.unit = unit
        where = self.path if line is None else f"{self.path} {unit} {line}"
        super().__init__(f"{where}: {problem}")


@dataclass
class Task:
    """A named dataset of train and eval rows plus the function that decides correctness.

    ``correctness(completion, row) -> float`` (1.0 correct, 0.0 not) is the single definition of
    "right answer" for the task: the ``"correct"`` reward and the accuracy metric both use it.
    ``instruction`` is the template used when ``prompts`` is not given one; builders pick the
    tagged or plain form to match how their correctness reads the answer. ``few_shot`` holds
    ``(question, response)`` worked examples shown before every question (``task.few_shot``).
    """

    name: str
    train_rows: list[dict]
    eval_rows: list[dict]
    correctness: Callable[[str, dict], float]
    instruction: str = DEFAULT_INSTRUCTION
    few_shot: tuple[tuple[str, str], ...] = ()
    environment: Callable[[], Any] | None = None  # makes the LM environment episodes run in (None: one turn)
    sources: tuple[str, str] = ("the train rows", "the eval rows")  # where the train and eval rows came from

    def prompts(
        self,
        tokenizer: Any,
        rows: Sequence[dict],
        instruction: str | None = None,
        system_prompt: str | None = None,
    ) -> list[str]:
        """Return one prompt string per row, in order (see ``format_prompt``): a conversational row's messages
        (`PROMPT_MESSAGES`) through the chat template as they stand, after the system prompt when they bring none.

        With an ``environment`` the prompt is its ``reset(row)`` through the chat template (the
        environment was built with the run's instruction and system prompt).
        """
        if self.environment is not None:
            return [render_messages(tokenizer, self.environment().reset(row)) for row in rows]
        template = self.instruction if instruction is None else instruction
        return [
            render_prompt(tokenizer, row[PROMPT_MESSAGES], system_prompt)
            if PROMPT_MESSAGES in row
            else format_prompt(tokenizer, row["question"], template, system_prompt, self.few_shot)
            for row in rows
        ]

    def unseen_train_rows(self) -> list[dict]:
        """Return the training rows whose question is not also a held-out question (for data from a model's answers)."""
        held_out = {row["question"] for row in self.eval_rows}
        return [row for row in self.train_rows if row["question"] not in held_out]


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """Return ``(line_number, row)`` for every non-blank line of a jsonl file (1-based lines).

    Line numbers travel with the rows so later validation can point at the offending line.
    """
    path = Path(path)
    if path.is_dir():
        raise TaskDataError(path, None, "is a directory, not a jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"task data file not found: {path}")
    rows = []
    # Bytes, decoded line by line: a text-mode reader fails on bad UTF-8 without saying where.
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            line = _decoded(raw, path, line_number)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskDataError(path, line_number, f"invalid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise TaskDataError(path, line_number, f"expected a JSON object, got {type(row).__name__}")
            rows.append((line_number, row))
    if not rows:
        raise TaskDataError(path, None, "file holds no rows")
    return rows


def _decoded(raw: bytes, path: Path, line_number: int) -> str:
    # A byte-order mark is legal at the start of a UTF-8 file and means nothing to JSON.
    try:
        return raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise TaskDataError(
            path,
            line_number,
            f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line); "
            "save the file as UTF-8",
        ) from None


def text_field(
    row: dict, field: str, path: str | Path, line: int, allow_numbers: bool = False, unit: str = "line"
) -> str:
    """Return ``row[field]`` as a string, or raise TaskDataError naming file, line and field.

    ``allow_numbers`` accepts JSON numbers (common for answers) and turns them into strings;
    ``unit`` is TaskDataError's ("row" for a dataset).
    """
    if field not in row:
        raise TaskDataError(path, line, f"missing field {field!r}; fields present: {sorted(row)}", unit)
    value = row[field]
    accepted = (str, int, float) if allow_numbers else (str,)
    if isinstance(value, bool) or not isinstance(value, accepted):
        kinds = "a string or a number" if allow_numbers else "a string"
        raise TaskDataError(path, line, f"field {field!r} must be {kinds}, got {type(value).__name__} {value!r}", unit)
    return str(value)


def first_rows(
    rows: list[dict], limit: int | None, what: str, key: str = "the row limit", holder: str = "the file"
) -> list[dict]:
    """Return the first ``limit`` rows (all of them when ``limit`` is None).

    ``key`` names the setting the limit came from (e.g. ``task.num_eval``) in the error for a limit
    the file cannot meet; ``holder`` what holds the rows there ("the dataset" for datasets).
    """
    if limit is None:
        return rows
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(f"{what}: {key} must be null or an integer >= 0, got {limit!r}")
    if limit > len(rows):
        raise ConfigError(
            f"{what}: {key} is {limit} but {holder} holds only {len(rows)} rows; "
            f"set it to at most {len(rows)}, or null for every row"
        )
    return rows[:limit]


def task_from_files(
    name: str,
    read: Callable[[str | Path], list[dict]],
    train_path: str | Path,
    eval_path: str | Path,
    *,
    num_train: int | None,
    num_eval: int | None,
    correctness: Callable[[str, dict], float],
    answer_in_tags: bool,
) -> Task:
    """Return the Task ``name`` over a train and an eval file, each read by ``read`` (path -> task rows), cut to its
    first ``num_train`` / ``num_eval`` rows (see `first_rows`), prompted to match ``answer_in_tags``."""
    return Task(
        name=name,
        train_rows=first_rows(read(train_path), num_train, f"{name} train {train_path}", "task.num_train"),
        eval_rows=first_rows(read(eval_path), num_eval, f"{name} eval {eval_path}", "task.num_eval"),
        correctness=correctness,
        instruction=default_instruction(answer_in_tags),
        sources=(str(train_path), str(eval_path)),
    )
