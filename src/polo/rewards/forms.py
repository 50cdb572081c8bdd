"""The forms a reward function may take, told apart by its signature, and how each is called.

- polo's own ``(completion: str, row: dict) -> float``, called once per sample;
- polo's batched ``(completions, rows) -> list[float]``, marked by the attribute ``batched = True``;
- TRL's ``(prompts, completions, completion_ids, **columns) -> list[float | None]``, called once per
  batch with keyword arguments only, as TRL's ``GRPOTrainer`` calls it: ``prompts`` as the dataset holds
  them (text, or a list of messages), ``completions`` as text, or as ``[{"role": "assistant",
  "content": text}]`` where the prompt was a list of messages, ``completion_ids`` the tokens sampled,
  ``trainer_state`` the run's progress, and every column of the dataset under its own name. ``None``
  means the function does not apply to that sample.

A function is TRL's when it names ``prompts``, ``completions`` or ``completion_ids``, or takes only
keywords (``**kwargs``); polo's when it takes two positional arguments. Anything else is refused
when the reward set is built, before a model loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from polo.config.schema import ConfigError
from polo.generation.prompts import PROMPT_MESSAGES, TRL_PROMPT

POLO_FORM = "(completion: str, row: dict) -> float"
TRL_FORM = "(prompts, completions, completion_ids, **columns) -> list[float | None]"
# What TRL passes besides the dataset's columns.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
# Keys of a row that are not passed as columns: polo's own, and those TRL passes otherwise or not at all.
NOT_COLUMNS = ("question", "prompt_text", PROMPT_MESSAGES, TRL_PROMPT, "prompt", "completion", "completion_ids")


@dataclass(frozen=True)
class RewardProgress:
    """How far the run is, passed to TRL-form rewards as ``trainer_state`` (TRL's ``TrainerState`` fields of the
    same names): ``global_step`` optimizer steps done before this batch, of ``max_steps``."""

    global_step: int = 0
    max_steps: int = 0


def _parameters(function: Callable) -> list[inspect.Parameter] | None:
    """Return the function's parameters, or None when Python cannot tell them (some builtins)."""
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None


def _takes_two_positionals(parameters: list[inspect.Parameter]) -> bool:
    """Return True when ``f(a, b)`` binds: two positional slots and no other required argument."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    slots = [parameter for parameter in parameters if parameter.kind in positional]
    required = [parameter for parameter in slots if parameter.default is inspect.Parameter.empty]
    others_required = [
        parameter
        for parameter in parameters
        if parameter.kind == inspect.Parameter.KEYWORD_ONLY and parameter.default is inspect.Parameter.empty
    ]
    varargs = any(parameter.kind == inspect.Parameter.VAR_POSITIONAL for parameter in parameters)
    return len(required) <= 2 and (len(slots) >= 2 or varargs) and not others_required


def is_trl_form(function: Callable, name: str) -> bool:
    """Return True for TRL's form, False for polo's (per sample, or batched); refuse any other in one line."""
    if getattr(function, "batched", False):
        return False
    parameters = _parameters(function)
    if parameters is None:
        return False  # nothing to read: called as polo's form, as before
    keyword_names = {
        parameter.name
        for parameter in parameters
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    if keyword_names & set(TRL_ARGUMENTS[:3]):
        return True
    if _takes_two_positionals(parameters):
        return False
    only_keywords = all(
        parameter.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        or parameter.default is not inspect.Parameter.empty
        for parameter in parameters
    )
    if only_keywords and any(parameter.kind == inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return True
    raise ConfigError(
        f"reward {name!r} takes {inspect.signature(function)}, which fits neither form a reward may take: "
        f"polo's {POLO_FORM} or TRL's {TRL_FORM}"
    )


def dataset_columns(rows: Sequence[dict]) -> list[str]:
    """Return the columns of the user's data in a task's rows (what TRL-form rewards get as keyword arguments)."""
    return [key for key in rows[0] if key not in NOT_COLUMNS] if rows else []


class TrlReward:
    """A reward function of TRL's form, called the way TRL's ``GRPOTrainer`` calls it (the module docstring).

    A function without ``**kwargs`` gets only the arguments it names; each one it requires must be a
    column of the task's rows, which `check_columns` says at set-up.
    """

    def __init__(self, function: Callable, name: str) -> None:
        self.function, self.name = function, name
        parameters = _parameters(function) or []
        self._takes_any = any(parameter.kind == inspect.Parameter.VAR_KEYWORD for parameter in parameters)
        self._names = {parameter.name for parameter in parameters}
        self._required = [
            parameter.name
            for parameter in parameters
            if parameter.default is inspect.Parameter.empty
            and parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        ]

    def check_columns(self, columns: Sequence[str]) -> None:
        """Raise ConfigError naming a required argument that is neither TRL's nor a column of ``columns``."""
        missing = [name for name in self._required if name not in TRL_ARGUMENTS and name not in columns]
        if missing:
            raise ConfigError(
                f"reward {self.name!r} needs {', '.join(repr(name) for name in missing)}, which is not a column of "
                f"the task's rows; their columns: {list(columns)} (and TRL's arguments {list(TRL_ARGUMENTS)})"
            )

    def __call__(
        self,
        completions: Sequence[str],
        rows: Sequence[dict],
        completion_ids: Sequence[Sequence[int]] | None,
        progress: RewardProgress,
    ) -> object:
        """Return the function's values for the batch: one float or None per completion (the caller checks them)."""
        conversational = [PROMPT_MESSAGES in row for row in rows]
        arguments = {
            "prompts": [row.get(TRL_PROMPT, row.get(PROMPT_MESSAGES, row.get("question"))) for row in rows],
            "completions": [
                [{"role": "assistant", "content": text}] if chat else text
                for text, chat in zip(completions, conversational)
            ],
            "completion_ids": [list(ids) for ids in completion_ids] if completion_ids is not None else None,
            "trainer_state": progress,
            **{column: [row.get(column) for row in rows] for column in dataset_columns(rows)},
        }
        if not self._takes_any:
            arguments = {key: value for key, value in arguments.items() if key in self._names}
        return self.function(**arguments)


def reward_caller(function: Callable, name: str, rows: Sequence[dict]) -> Callable:
    """Return `function` as the reward set calls it: a TRL-form function wrapped in `TrlReward` and checked against
    the columns of the task's ``rows``, polo's as it is; a function of neither form is refused (`is_trl_form`)."""
    if not is_trl_form(function, name):
        return function
    wrapped = TrlReward(function, name)
    wrapped.check_columns(dataset_columns(rows))
    return wrapped


__all__ = ["POLO_FORM", "TRL_FORM", "RewardProgress", "TrlReward", "dataset_columns", "is_trl_form", "reward_caller"]
