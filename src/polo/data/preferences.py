"""Data for SFT, reward models and DPO: demonstrations, ranked comparisons, and a built-in set.

Two jsonl row kinds, read with file-and-line errors (`TaskDataError`):

- a **demonstration** (SFT): ``{"prompt": ..., "response": ...}``, or a chat
  ``{"messages": [{"role": "user", "content": ...}, ..., {"role": "assistant", "content": ...}]}``
  whose last message is the assistant's reply (the one trained on).
- a **comparison** (reward model, DPO): ``{"prompt": ..., "chosen": ..., "rejected": ...}``, or a
  K-way ranking ``{"prompt": ..., "ranked": [best, ..., worst]}``; a ranking stands for all its
  K(K−1)/2 (better, worse) pairs.

A ``prompt`` is the user's message (a string) or a list of chat messages ending with a user
turn; the chat template (with ``add_generation_prompt``) turns it into the text the model sees,
the same way `polo.data.base.format_prompt` phrases RL prompts. Other fields are kept out
of the way and ignored.

`arithmetic_preference_data` builds a demonstration set: arithmetic problems from
`polo.data.arithmetic`, phrased with the arithmetic task's own instruction; demonstrations
give the correct concise answer, comparisons prefer it to the same answer with a mistake in the
carry, the tens digit or the units digit (see `wrong_answer`).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polo.data.arithmetic import OPERATIONS, arithmetic_task
from polo.data.base import Task, TaskDataError, fill_instruction, read_jsonl
from polo.data.hf import numbered_rows
from polo.generation.prompts import prompt_messages

ROLES = ("system", "user", "assistant", "tool")  # tool: an observation in a multi-turn episode (docs/tools.md)


@dataclass(frozen=True)
class Demonstration:
    """One SFT example: the conversation before the reply, and the reply to learn."""

    messages: tuple[dict, ...]  # ends with a user turn (or a tool's output, mid-episode)
    response: str


@dataclass(frozen=True)
class Ranking:
    """Responses to one prompt, best first; a chosen/rejected pair is a ranking of two."""

    messages: tuple[dict, ...]
    responses: tuple[str, ...]

    def pairs(self) -> list[tuple[str, str]]:
        """Return every (better, worse) pair of responses: K(K−1)/2 of them, better first."""
        return [(self.responses[better], self.responses[worse]) for better, worse in ranking_pairs(len(self.responses))]


def ranking_pairs(num_responses: int) -> list[tuple[int, int]]:
    """Return the (better, worse) index pairs of a ranking of K responses: all i < j, K(K−1)/2 of them."""
    if num_responses < 2:
        raise ValueError(f"a ranking needs at least 2 responses, got {num_responses}")
    return list(itertools.combinations(range(num_responses), 2))


# ---------------------------------------------------------------- reading


def _messages(value: Any, field: str, path: str | Path, line: int) -> tuple[dict, ...]:
    """Return a prompt (string or list of chat messages) as a tuple of {"role", "content"} dicts."""
    if isinstance(value, str):
        return ({"role": "user", "content": value},)
    if not isinstance(value, list) or not value:
        raise TaskDataError(
            path,
            line,
            f"field {field!r} must be a string or a non-empty list of chat messages, "
            f"got {type(value).__name__} {value!r}",
        )
    messages = []
    for index, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise TaskDataError(
                path,
                line,
                f'{field}[{index}] must be {{"role": one of {list(ROLES)}, "content": a string}}, got {message!r}',
            )
        messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)


def _text(row: dict, field: str, path: str | Path, line: int) -> str:
    """Return row[field] as a string, or raise TaskDataError naming file, line and field."""
    if field not in row:
        raise TaskDataError(path, line, f"missing field {field!r}; fields present: {sorted(row)}")
    if not isinstance(row[field], str):
        raise TaskDataError(
            path, line, f"field {field!r} must be a string, got {type(row[field]).__name__} {row[field]!r}"
        )
    return row[field]


def demonstration_from_row(row: dict, path: str | Path, line: int) -> Demonstration:
    """Return the demonstration a jsonl row holds (prompt/response, or chat messages)."""
    if "messages" in row:
        messages = _messages(row["messages"], "messages", path, line)
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise TaskDataError(
                path,
                line,
                "field 'messages' must end with an assistant message (the reply to learn) after at least one "
                "other message",
            )
        prompt = messages[:-1]
        response = messages[-1]["content"]
    elif "prompt" in row:
        prompt = _messages(row["prompt"], "prompt", path, line)
        response = _text(row, "response", path, line)
    else:
        raise TaskDataError(
            path, line, f"a demonstration needs 'prompt' and 'response', or 'messages'; fields present: {sorted(row)}"
        )
    if prompt[-1]["role"] not in ("user", "tool"):  # a tool's output: the model's next turn in an episode
        raise TaskDataError(
            path, line, f"the prompt must end with a user or tool message, got a {prompt[-1]['role']!r} message"
        )
    return Demonstration(prompt, response)


def ranking_from_row(row: dict, path: str | Path, line: int) -> Ranking:
    """Return the ranking a jsonl row holds (chosen/rejected, or ranked best to worst)."""
    if "prompt" not in row:
        raise TaskDataError(path, line, f"missing field 'prompt'; fields present: {sorted(row)}")
    messages = _messages(row["prompt"], "prompt", path, line)
    if messages[-1]["role"] != "user":
        raise TaskDataError(
            path, line, f"the prompt must end with a user message, got a {messages[-1]['role']!r} message"
        )
    if "ranked" in row:
        ranked = row["ranked"]
        if not isinstance(ranked, list) or len(ranked) < 2 or not all(isinstance(text, str) for text in ranked):
            raise TaskDataError(
                path, line, f"field 'ranked' must be a list of at least 2 strings, best first, got {ranked!r}"
            )
        responses = tuple(ranked)
    elif "chosen" in row or "rejected" in row:
        responses = (_text(row, "chosen", path, line), _text(row, "rejected", path, line))
    else:
        raise TaskDataError(
            path, line, f"a comparison needs 'chosen' and 'rejected', or 'ranked'; fields present: {sorted(row)}"
        )
    if len(set(responses)) != len(responses):
        raise TaskDataError(
            path, line, "a ranking holds the same response twice; a response cannot be preferred to itself"
        )
    return Ranking(messages, responses)


def rows_of(data: Any, source: str, from_row: Callable[[dict, str | Path, int], Any], limit: int | None = None) -> list:
    """Return `from_row(row, source, index)` for the first `limit` rows of a ``datasets.Dataset`` or a list of dicts.

    The rows go through the same checks as a jsonl file's (`demonstration_from_row`,
    `ranking_from_row`); a bad one is named by its 0-based index, as ``data[index]``, in one line.
    """
    rows = numbered_rows(data, source)[:limit]
    if not rows:
        raise TaskDataError(source, None, "holds no rows")
    read = []
    for index, row in rows:
        if not isinstance(row, dict):
            raise TaskDataError(source, index, f"expected a dict of fields, got {type(row).__name__}", unit="row")
        try:
            read.append(from_row(row, source, index))
        except TaskDataError as error:  # the row checks speak of lines; a dataset's rows are counted from 0
            raise TaskDataError(source, index, error.problem, unit="row") from None
    return read


def read_rows(path: str | Path, from_row: Callable[[dict, str | Path, int], Any], limit: int | None = None) -> list:
    """Return `from_row(row, path, line)` for the first `limit` rows of a jsonl file (all when None)."""
    return [from_row(row, path, line) for line, row in read_jsonl(path)[:limit]]


def read_demonstrations(path: str | Path, limit: int | None = None) -> list[Demonstration]:
    """Return the demonstrations of a jsonl file (the first `limit` when given)."""
    return read_rows(path, demonstration_from_row, limit)


def read_rankings(path: str | Path, limit: int | None = None) -> list[Ranking]:
    """Return the comparisons of a jsonl file as rankings (the first `limit` when given)."""
    return read_rows(path, ranking_from_row, limit)


# ---------------------------------------------------------------- the built-in arithmetic set


def concise_answer(a: int, op: str, b: int, value: int) -> str:
    """Return the short answer form the default model already uses: "47 + 38 = 85"."""
    return f"{a} {op} {b} = {value}"


# The kinds of wrong answer the built-in comparisons can hold (`wrong_answer`), and the default:
# carry mistakes only, the SFT model's own (docs/rlhf.md has what the other kinds did).
MISTAKES = ("carry", "tens", "units")
DEFAULT_MISTAKES = ("carry",)


def has_carry(a: int, b: int) -> bool:
    """Whether adding a and b carries from the units into the tens: 47 + 38 does (7 + 8 = 15), 41 + 38 does not."""
    return abs(a) % 10 + abs(b) % 10 >= 10


def wrong_answer(a: int, op: str, b: int, mistake: str, rng: random.Random) -> int:
    """Return a wrong value of `a op b` with one kind of mistake (never the right value; below zero only if it is).

    - ``"carry"``: the carry into the tens done wrong, for a sum: forgotten when there is one
      (47 + 38 = 75), added when there is none (41 + 38 = 89). Off by 10 in the direction a slip
      in the carry goes; the SFT model's own mistakes are of this kind (24 of its 28 wrong greedy
      answers on the held-out sums, docs/rlhf.md). For − and ×, off by 10 either way.
    - ``"tens"``: the tens digit off by one the other way (47 + 38 = 95, 41 + 38 = 69), so a
      reward model cannot pass by scoring "a carry means a larger tens digit".
    - ``"units"``: off by one (47 + 38 = 84 or 86).
    """
    value = OPERATIONS[op](a, b)
    if mistake == "units":
        step = rng.choice([-1, 1])
    elif mistake in ("carry", "tens"):
        if op == "+":
            carry_step = -10 if has_carry(a, b) else 10
            step = carry_step if mistake == "carry" else -carry_step
        else:
            step = rng.choice([-10, 10])
    else:
        raise ValueError(f"unknown mistake {mistake!r}; valid: {', '.join(MISTAKES)}")
    wrong = value + step
    return wrong if wrong >= 0 else value + abs(step)


def arithmetic_comparison(
    prompt: str, problem: tuple[int, str, int], rng: random.Random, mistake: str = "carry"
) -> dict:
    """Return a comparison row for one problem: the correct answer over the same answer with `mistake`.

    Both are in the concise form the SFT demonstrations teach ("47 + 38 = 85" over "47 + 38 = 75"):
    same length, same wording, so only checking the sum tells them apart (`wrong_answer` lists the
    mistakes). The row keeps the mistake's name in `"mistake"` (ignored by training).
    """
    a, op, b = problem
    value = OPERATIONS[op](a, b)
    wrong = wrong_answer(a, op, b, mistake, rng)
    return {
        "prompt": prompt,
        "chosen": concise_answer(a, op, b, value),
        "rejected": concise_answer(a, op, b, wrong),
        "answer": str(value),
        "mistake": mistake,
    }


def arithmetic_preference_data(
    task: Task | None = None,
    *,
    instruction: str | None = None,
    seed: int = 0,
    num_sft: int = 1000,
    num_sft_eval: int = 100,
    num_comparisons: int = 3000,
    num_comparisons_eval: int = 200,
    mistakes: Sequence[str] = DEFAULT_MISTAKES,
) -> dict[str, list[dict]]:
    """Return the four splits {"sft_train", "sft_eval", "preferences_train", "preferences_eval"} as jsonl rows.

    `task` is the arithmetic task of the RL run (`polo.rl.train.make_task` of its recipe; None:
    the default one). Problems come from its training split only, so none of the RL run's held-out
    problems appear, and the four splits are disjoint from each other. Prompts are `instruction`
    (the RL run's, `polo.rl.train.instruction_for`; None: the task's own) filled with the
    question, so the models see the prompts the policy sees during RL. The comparisons' wrong
    answers cycle through `mistakes` (kinds of `wrong_answer`) problem by problem.
    """
    mistakes = tuple(mistakes)
    unknown = [name for name in mistakes if name not in MISTAKES]
    if not mistakes or unknown:
        raise ValueError(f"mistakes must name at least one of {', '.join(MISTAKES)}; got {list(mistakes)}")
    task = arithmetic_task() if task is None else task
    if task.train_rows and "operands" not in task.train_rows[0]:
        raise ValueError(f"the built-in preference data needs an arithmetic task, got task {task.name!r}")
    template = task.instruction if instruction is None else instruction
    held_out = {row["question"] for row in task.eval_rows}
    rows = [row for row in task.train_rows if row["question"] not in held_out]  # disjoint already; made explicit
    sizes = {
        "sft_train": num_sft,
        "sft_eval": num_sft_eval,
        "preferences_train": num_comparisons,
        "preferences_eval": num_comparisons_eval,
    }
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{name}: the number of rows must be an integer >= 0, got {size!r}")
    if sum(sizes.values()) > len(rows):
        raise ValueError(
            f"the splits ask for {sum(sizes.values())} problems ({sizes}) but the arithmetic task's training "
            f"split holds {len(rows)}; lower the counts or raise task.num_train"
        )
    rng = random.Random(seed)
    rows = list(rows)
    rng.shuffle(rows)
    splits, start = {}, 0
    for name, size in sizes.items():
        out = []
        for row in rows[start : start + size]:
            a, b = row["operands"]
            prompt = fill_instruction(template, row["question"])
            if name.startswith("sft"):
                out.append(
                    {
                        "prompt": prompt,
                        "response": concise_answer(a, row["operator"], b, int(row["answer"])),
                        "answer": row["answer"],
                    }
                )
            else:
                mistake = mistakes[len(out) % len(mistakes)]
                out.append(arithmetic_comparison(prompt, (a, row["operator"], b), rng, mistake))
        splits[name] = out
        start += size
    return splits


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    """Write `rows` to `path`, one JSON object a line; return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_arithmetic_preferences(output_dir: str | Path, task: Task | None = None, **options: Any) -> dict[str, Path]:
    """Return the paths of the splits of `arithmetic_preference_data(task, **options)`, written to
    `<output_dir>/<split>.jsonl`."""
    output_dir = Path(output_dir)
    splits = arithmetic_preference_data(task, **options)
    return {name: write_jsonl(output_dir / f"{name}.jsonl", rows) for name, rows in splits.items()}


# ---------------------------------------------------------------- comparisons from a model's own samples


def user_prompt(
    question: str, instruction: str, system_prompt: str | None = None, few_shot: Sequence[tuple[str, str]] = ()
) -> str | list[dict]:
    """Return the `prompt` field of a data row for `question`: the filled instruction alone, or the
    messages (system, worked examples, question) when there is more than the question."""
    messages = prompt_messages(question, instruction, system_prompt, few_shot)
    return messages[0]["content"] if len(messages) == 1 else messages


def comparisons_from_samples(
    prompt: str | list[dict], samples: Sequence[tuple[str, float]], rng: random.Random, max_pairs: int = 4
) -> list[dict]:
    """Return up to `max_pairs` comparison rows ranking a correct sample above a wrong one, for one prompt.

    `samples` are (completion, correctness) for the prompt, correctness > 0.5 counting as right:
    the checker plays the labeller who ranks the model's outputs. Duplicate completions count
    once. Pairs are drawn without replacement from (correct × wrong), so a prompt whose samples
    are all right or all wrong gives none.
    """
    right = sorted({text for text, score in samples if score > 0.5})
    wrong = sorted({text for text, score in samples if score <= 0.5})
    pairs = [(chosen, rejected) for chosen in right for rejected in wrong]
    picked = rng.sample(pairs, min(max_pairs, len(pairs)))
    return [
        {"prompt": prompt, "chosen": chosen, "rejected": rejected, "source": "samples"} for chosen, rejected in picked
    ]
