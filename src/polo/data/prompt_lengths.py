"""Prompts checked against the model's context when a run loads, before any is sampled.

A prompt whose tokens leave no room for the completion budget in the model's context cannot be
sampled: it is refused in one line naming where it came from, its length and the context, or, with
``task.truncate_prompts``, its question is cut from the start until it fits (the end keeps the
question itself and the chat template's opening of the reply) and a warning says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polo.data.base import Task, TaskDataError
from polo.generation.prompts import PROMPT_MESSAGES
from polo.models.family import encode_prompts


@dataclass(frozen=True)
class PromptRoom:
    """How a run's prompts must fit: the model's ``context`` (tokens), and per split the completion budget that comes
    after the prompt and the setting that holds it."""

    context: int
    train_budget: tuple[str, int]  # ("sampling.max_new_tokens", 64)
    eval_budget: tuple[str, int]
    instruction: str | None = None
    system_prompt: str | None = None


def _lengths(task: Task, tokenizer: Any, rows: Sequence[dict], room: PromptRoom) -> list[int]:
    """Return each row's prompt length in tokens, as the sampler will see it."""
    prompts = task.prompts(tokenizer, rows, room.instruction, room.system_prompt)
    return [len(ids) for ids in encode_prompts(tokenizer, prompts)]


def _cut_question(row: dict, tokenizer: Any, tokens: int) -> dict:
    """Return `row` with the first `tokens` tokens of its question (a conversation's last message) cut off."""
    text = row[PROMPT_MESSAGES][-1]["content"] if PROMPT_MESSAGES in row else row["question"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    kept = tokenizer.decode(ids[tokens:], skip_special_tokens=False) if tokens < len(ids) else ""
    if PROMPT_MESSAGES in row:
        messages = [*row[PROMPT_MESSAGES][:-1], {**row[PROMPT_MESSAGES][-1], "content": kept}]
        return {**row, PROMPT_MESSAGES: messages, "question": kept}
    return {**row, "question": kept}


def _fitted(task: Task, tokenizer: Any, row: dict, limit: int, room: PromptRoom) -> dict | None:
    """Return `row` with its question cut from the start so its prompt is at most `limit` tokens, None when even an
    empty question would not fit."""
    length = _lengths(task, tokenizer, [row], room)[0]
    cut = 0
    while length > limit:
        cut += length - limit  # tokens of the question and of the prompt need not match one for one: cut again
        shorter = _cut_question(row, tokenizer, cut)
        if not shorter["question"]:
            return None
        length = _lengths(task, tokenizer, [shorter], room)[0]
        row = shorter if length <= limit else row
    return row


def fit_split(task: Task, tokenizer: Any, split: str, room: PromptRoom, truncate: bool) -> list[str]:
    """Check (and with `truncate`, cut) the prompts of ``task``'s ``split`` ("train" or "eval"); return the warnings.

    Raises TaskDataError naming the first prompt too long, where it came from (``task.sources``), its
    length, the budget and the context, and how many more there are.
    """
    rows = task.train_rows if split == "train" else task.eval_rows
    key, budget = room.train_budget if split == "train" else room.eval_budget
    limit = room.context - budget
    lengths = _lengths(task, tokenizer, rows, room) if rows else []
    too_long = [index for index, length in enumerate(lengths) if length > limit]
    if not too_long:
        return []
    source = task.sources[0 if split == "train" else 1]
    first = too_long[0]
    problem = (
        f"its prompt is {lengths[first]} tokens, and with {key} {budget} it does not fit the model's context of "
        f"{room.context} tokens"
    )
    more = f" ({len(too_long) - 1} more rows of it are too long too)" if len(too_long) > 1 else ""
    if not truncate:
        raise TaskDataError(
            source, first, f"{problem}{more}; shorten or drop it, or set task.truncate_prompts=true", unit="row"
        )
    fitted = list(rows)
    for index in too_long:
        row = _fitted(task, tokenizer, rows[index], limit, room)
        if row is None:
            raise TaskDataError(source, index, f"{problem}, even with its question cut away", unit="row")
        fitted[index] = row
    rows[:] = fitted
    return [
        f"polo: warning: {source}: {len(too_long)} prompt(s) cut from their start to fit {limit} tokens "
        f"(the model's context of {room.context} less {key} {budget}), the first row {first} "
        f"({lengths[first]} tokens; task.truncate_prompts)"
    ]


def fit_prompts(task: Task, tokenizer: Any, room: PromptRoom, truncate: bool) -> list[str]:
    """Check every prompt of ``task`` against the model's context (`fit_split`), train rows then eval rows; return the
    warnings of what was cut."""
    return [*fit_split(task, tokenizer, "train", room, truncate), *fit_split(task, tokenizer, "eval", room, truncate)]


__all__ = ["PromptRoom", "fit_prompts", "fit_split"]
