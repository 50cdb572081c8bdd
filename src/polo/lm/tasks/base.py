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

QUESTION_PLACEHOLDER = "{question}"

# R1-Zero style: reasoning and answer in separate tags, so the format reward and the
# answer extraction have something unambiguous to look for.
DEFAULT_INSTRUCTION = (
    "{question}\n\n"
    "First think through the problem step by step inside <think> </think> tags. "
    "Then give only the final answer inside <answer> </answer> tags, "
    "for example <answer>42</answer>."
)

# For tasks whose correctness looks at the last number in the text rather than a tag.
PLAIN_INSTRUCTION = (
    "{question}\n\n"
    "Answer briefly, and end your reply with the final number."
)


class TaskDataError(ValueError):
    """A task data file holds a row that cannot be used; the message names file and line."""

    def __init__(self, path: str | Path, line: int | None, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        where = self.path if line is None else f"{self.path} line {line}"
        super().__init__(f"{where}: {problem}")


def default_instruction(answer_in_tags: bool) -> str:
    """Return the instruction template that matches how a task's correctness reads answers."""
    return DEFAULT_INSTRUCTION if answer_in_tags else PLAIN_INSTRUCTION


def fill_instruction(instruction: str, question: str) -> str:
    """Return ``instruction`` with its ``{question}`` placeholder replaced by ``question``."""
    if QUESTION_PLACEHOLDER not in instruction:
        raise ValueError(
            f"instruction template {instruction!r} has no {QUESTION_PLACEHOLDER!r} placeholder; "
            f"a template must contain {QUESTION_PLACEHOLDER!r} exactly where the question goes"
        )
    # str.replace rather than str.format: templates and questions may contain literal braces
    # (LaTeX, JSON examples) that format() would try to interpret.
    return instruction.replace(QUESTION_PLACEHOLDER, question)


def format_prompt(
    tokenizer: Any,
    question: str,
    instruction: str = DEFAULT_INSTRUCTION,
    system_prompt: str | None = None,
) -> str:
    """Return the prompt text for one question, through the chat template when there is one.

    With a chat template the filled instruction becomes the user message (after an optional
    system message) and the assistant turn is opened (``add_generation_prompt=True``), so the
    completion is exactly the assistant's reply. Without one (base models) the prompt is the
    filled instruction followed by a newline; ``system_prompt`` then goes first, on its own
    paragraph, so it is not silently dropped.
    """
    filled = fill_instruction(instruction, question)
    if getattr(tokenizer, "chat_template", None):
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": filled})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    preamble = "" if system_prompt is None else system_prompt + "\n\n"
    return preamble + filled + "\n"


@dataclass
class Task:
    """A named dataset of train and eval rows plus the function that decides correctness.

    ``correctness(completion, row) -> float`` (1.0 correct, 0.0 not) is the single definition of
    "right answer" for the task: the ``"correct"`` reward and the accuracy metric both use it.
    ``instruction`` is the template used when ``prompts`` is not given one; builders pick the
    tagged or plain form to match how their correctness reads the answer.
    """

    name: str
    train_rows: list[dict]
    eval_rows: list[dict]
    correctness: Callable[[str, dict], float]
    instruction: str = DEFAULT_INSTRUCTION

    def prompts(
        self,
        tokenizer: Any,
        rows: Sequence[dict],
        instruction: str | None = None,
        system_prompt: str | None = None,
    ) -> list[str]:
        """Return one prompt string per row, in order (see ``format_prompt``)."""
        template = self.instruction if instruction is None else instruction
        return [format_prompt(tokenizer, row["question"], template, system_prompt) for row in rows]


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """Return ``(line_number, row)`` for every non-blank line of a jsonl file (1-based lines).

    Line numbers travel with the rows so later validation can point at the offending line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task data file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskDataError(
                    path, line_number, f"invalid JSON ({exc.msg} at column {exc.colno})"
                ) from exc
            if not isinstance(row, dict):
                raise TaskDataError(
                    path, line_number, f"expected a JSON object, got {type(row).__name__}"
                )
            rows.append((line_number, row))
    if not rows:
        raise TaskDataError(path, None, "file holds no rows")
    return rows


def text_field(
    row: dict, field: str, path: str | Path, line: int, allow_numbers: bool = False
) -> str:
    """Return ``row[field]`` as a string, or raise TaskDataError naming file, line and field.

    ``allow_numbers`` accepts JSON numbers (common for answers) and turns them into strings.
    """
    if field not in row:
        raise TaskDataError(
            path, line, f"missing field {field!r}; fields present: {sorted(row)}"
        )
    value = row[field]
    accepted = (str, int, float) if allow_numbers else (str,)
    if isinstance(value, bool) or not isinstance(value, accepted):
        kinds = "a string or a number" if allow_numbers else "a string"
        raise TaskDataError(
            path, line, f"field {field!r} must be {kinds}, got {type(value).__name__} {value!r}"
        )
    return str(value)


def first_rows(rows: list[dict], limit: int | None, what: str) -> list[dict]:
    """Return the first ``limit`` rows (all of them when ``limit`` is None)."""
    if limit is None:
        return rows
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"{what}: row limit must be None or an integer >= 0, got {limit!r}")
    if limit > len(rows):
        raise ValueError(f"{what}: asked for {limit} rows but the file holds only {len(rows)}")
    return rows[:limit]
