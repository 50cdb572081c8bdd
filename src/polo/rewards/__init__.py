"""Reward functions and their weighted combination.

A reward is any plain function ``(completion: str, row: dict) -> float``, or a *batched* one:
a callable with the attribute ``batched = True`` that takes ``(completions, rows)`` and returns
one float per completion (a learned reward model scores a whole batch in one forward pass).
Rewards are named in configs by a registered name (``REWARDS``, `polo.core.registry`: each built-in
registers itself with ``@register_reward`` where it is defined), by a reward model
``"model:PATH"`` (see `polo.finetune.reward_model`), by an import path ``"package.module:function"``,
or passed directly as callables; ``RewardSet`` combines them with weights and keeps each one's
raw column for logging.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from polo.config.plugins import import_user_module
from polo.config.schema import ConfigError
from polo.core.registry import REWARDS, register_reward
from polo.rewards.answers import (
    CHECKERS,
    answer_region,
    checker,
    exact_number,
    exact_string,
    extract_last_number,
    extract_tagged_answer,
    math_verify_answer,
    parse_number,
)
from polo.rewards.code import code_fraction_reward, code_reward  # noqa: F401  (imported, they register)
from polo.rewards.format import r1_format, tag_count
from polo.runtime.device import CPU
from polo.sandbox.runner import SandboxError

if TYPE_CHECKING:  # only for annotations: tasks import rewards, so no runtime cycle
    from polo.data.base import Task

RewardFn = Callable[[str, dict], float]

logger = logging.getLogger(__name__)

_SNIPPET_CHARS = 80


BUILTIN_REWARDS = REWARDS  # the older name of the registry


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable for one sample."""

    def __init__(self, reward_name: str, sample_index: int, completion: str, reason: str, kind: str = "error") -> None:
        self.reward_name = reward_name
        self.sample_index = sample_index
        self.kind = kind  # counted as reward/<name>/failures/<kind> where the error is scored 0
        completion = completion if isinstance(completion, str) else repr(completion)
        snippet = completion[:_SNIPPET_CHARS] + ("..." if len(completion) > _SNIPPET_CHARS else "")
        super().__init__(
            f"reward function {reward_name!r} failed on sample {sample_index} (completion {snippet!r}): {reason}"
        )


def callable_name(function: Callable) -> str:
    """Return a readable name for a reward callable (``__name__``, seeing through partials)."""
    name = getattr(function, "__name__", None) or getattr(getattr(function, "func", None), "__name__", None)
    return name or type(function).__name__


def import_reward(path: str) -> RewardFn:
    """Return the callable named by ``"package.module:function"``."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"reward import path {path!r} must look like 'package.module:function'")
    try:
        # Also finds my_module.py in the current directory, as `python -m` would.
        module = import_user_module(module_name, f"reward {path!r}")
    except ConfigError as exc:
        # Only "this module does not exist" lands here; a missing dependency *inside* the
        # user's module is their bug and keeps its own traceback.
        raise ModuleNotFoundError(str(exc), name=module_name) from exc
    if not hasattr(module, attribute):
        raise AttributeError(f"reward {path!r}: module {module_name!r} has no attribute {attribute!r}")
    function = getattr(module, attribute)
    if not callable(function):
        raise TypeError(f"reward {path!r} is a {type(function).__name__}, not a callable (completion, row) -> float")
    return function


def resolve_reward(name_or_callable: str | RewardFn, task: Task) -> tuple[str, RewardFn]:
    """Return ``(name, function)`` for a builtin name, an import path or a callable."""
    if callable(name_or_callable):
        return callable_name(name_or_callable), name_or_callable
    if not isinstance(name_or_callable, str):
        raise TypeError(
            f"a reward must be a name or a callable, got {type(name_or_callable).__name__} {name_or_callable!r}"
        )
    if name_or_callable in REWARDS and ":" not in name_or_callable:
        return name_or_callable, REWARDS[name_or_callable](task)
    if name_or_callable.startswith("model:"):
        from polo.rewards.reward_model import LOG_NAME, reward_model_reward

        return LOG_NAME, reward_model_reward(name_or_callable, task)
    if ":" in name_or_callable:
        # Logged under the function's own name: shorter columns, and RewardSet rejects clashes.
        return name_or_callable.rpartition(":")[2], import_reward(name_or_callable)
    raise ValueError(
        f"unknown reward {name_or_callable!r}; registered rewards: {', '.join(REWARDS)}, "
        "a reward model as 'model:PATH', or your own function as 'package.module:function'"
    )


def _checked_value(value: object, name: str, index: int, completion: str) -> float:
    """Return a reward value as float, or raise RewardFunctionError if it is not a finite number."""
    if not isinstance(value, numbers.Real):
        raise RewardFunctionError(
            name, index, completion, f"returned {type(value).__name__} {value!r:.80}, expected a float", "not_a_number"
        )
    if not math.isfinite(value):
        raise RewardFunctionError(name, index, completion, f"returned non-finite value {value!r}", "non_finite")
    return float(value)


def _score_column(
    name: str,
    function: RewardFn,
    completions: Sequence[str],
    rows: Sequence[dict],
    errors: list[RewardFunctionError] | None = None,
    device: torch.device = CPU.device,
) -> torch.Tensor:
    """Return one reward function's values for the batch, shape (batch,) float32 on `device`.

    A sample whose function raises (or returns a non-finite or non-number value) stops the
    batch with `RewardFunctionError`, unless `errors` is a list: then it scores 0 and its
    error is appended there. A batched function (``batched = True``) is called once for the
    whole batch; if that call raises, it is called again one sample at a time, so the error
    still names the sample that failed. Returning the wrong number of values always raises.
    """
    batch_values = None
    if getattr(function, "batched", False):
        batch_values = _batched_values(name, function, completions, rows)
        if batch_values is None:  # rescore one sample at a time, so the error names the sample
            function = functools.partial(_single_value, function)
    values = []
    for index, (completion, row) in enumerate(zip(completions, rows)):
        try:
            if batch_values is not None:
                values.append(_checked_value(batch_values[index], name, index, completion))
            else:
                values.append(_sample_reward(name, function, index, completion, row))
        except RewardFunctionError as error:
            if errors is None:
                raise
            errors.append(error)
            values.append(0.0)
    return torch.tensor(values, dtype=torch.float32, device=device)


def _sample_reward(name: str, function: RewardFn, index: int, completion: str, row: dict) -> float:
    """Return `function(completion, row)` checked, any exception turned into a `RewardFunctionError` for this sample."""
    try:
        value = function(completion, row)
    except SandboxError:
        raise  # the machine cannot run the sandbox at all: no completion caused it, so stop
    except Exception as exc:
        raise RewardFunctionError(name, index, completion, f"{type(exc).__name__}: {exc}", type(exc).__name__) from exc
    return _checked_value(value, name, index, completion)


def _as_list(values: object) -> list:
    """Return a batched function's result as a list (tensors and arrays become Python numbers)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return list(values)


def _batched_values(name: str, function: Callable, completions: Sequence[str], rows: Sequence[dict]) -> list | None:
    """Return a batched function's values for the whole batch, or None if the call raised.

    A wrong number of values is a bug of the function rather than of a sample: it always raises
    `RewardFunctionError`, naming the first sample left without a value.
    """
    try:
        values = _as_list(function(list(completions), list(rows)))
    except Exception:  # rescored per sample by the caller, which names the failing sample
        return None
    if len(values) != len(completions):
        index = min(len(values), len(completions) - 1)
        raise RewardFunctionError(
            name,
            index,
            completions[index],
            f"batched reward returned {len(values)} values for {len(completions)} completions",
        )
    return values


def _single_value(function: Callable, completion: str, row: dict) -> object:
    """Return a batched function's value for one sample (a batch of one)."""
    values = _as_list(function([completion], [row]))
    if len(values) != 1:
        raise ValueError(f"a batched reward returned {len(values)} values for 1 completion")
    return values[0]


def _is_finite_number(value: object) -> bool:
    """Return True for a finite real number that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def _check_batch(completions: Sequence[str], rows: Sequence[dict]) -> None:
    """Raise ValueError unless there is exactly one row per completion."""
    if len(completions) != len(rows):
        raise ValueError(
            f"got {len(completions)} completions but {len(rows)} rows; "
            "pass one row per completion (repeat each prompt's row for its group)"
        )


class RewardSet:
    """A weighted sum of reward functions for one task.

    ``weights`` maps each reward (builtin name, ``"module:function"`` path or callable) to its
    weight. Every function is evaluated even at weight 0, so a reward can be logged without
    being optimised.
    """

    def __init__(self, weights: Mapping[str | RewardFn, float], task: Task, on_error: str = "raise") -> None:
        if not weights:
            raise ValueError(f"a RewardSet needs at least one reward; registered rewards: {', '.join(REWARDS)}")
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        self.task = task
        self.on_error = on_error
        self._correctness_failures: collections.Counter[str] = collections.Counter()
        # The errors of the last `score` call (on_error="zero"), for the caller to count and log.
        self.last_errors: list[RewardFunctionError] = []
        self._functions: dict[str, RewardFn] = {}
        self._weights: dict[str, float] = {}
        for reward, weight in weights.items():
            name, function = resolve_reward(reward, task)
            if isinstance(reward, str) and reward.startswith("model:"):
                # Several reward models are logged as rm, rm2, rm3, ... in the order given.
                base, count = name, 1
                while name in self._functions:
                    count += 1
                    name = f"{base}{count}"
            if name in self._functions:
                raise ValueError(
                    f"two rewards share the name {name!r}; rename one of the functions "
                    "so their logged columns stay distinct"
                )
            if not _is_finite_number(weight):
                raise ValueError(f"reward {name!r} has weight {weight!r}; expected a finite number")
            self._functions[name] = function
            self._weights[name] = float(weight)

    @property
    def names(self) -> list[str]:
        """Return the reward names in the order given."""
        return list(self._functions)

    @property
    def weights(self) -> dict[str, float]:
        """Return a copy of the name -> weight mapping."""
        return dict(self._weights)

    def score(
        self,
        completions: Sequence[str],
        rows: Sequence[dict],
        device: torch.device = CPU.device,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return the weighted total (batch,) float32 and each reward's raw values (batch,), on `device`.

        ``total[i] = sum_k weight_k * reward_k(completions[i], rows[i])``. With
        ``on_error="zero"`` a failing sample scores 0 for that function and the error is kept
        in ``last_errors``; otherwise the first failure raises `RewardFunctionError`.
        """
        _check_batch(completions, rows)
        self.last_errors = []
        errors = self.last_errors if self.on_error == "zero" else None
        columns = {
            name: _score_column(name, function, completions, rows, errors, device)
            for name, function in self._functions.items()
        }
        total = torch.zeros(len(completions), dtype=torch.float32, device=device)
        for name, column in columns.items():
            total += self._weights[name] * column
        return total, columns

    def failure_counts(self) -> dict[str, dict[str, int]]:
        """Return, per reward that reports them (like ``code``, and ``correct``), its failure counts by kind since
        the last call."""
        counts = {
            name: function.pop_failure_counts()
            for name, function in self._functions.items()
            if callable(getattr(function, "pop_failure_counts", None))
        }
        if self._correctness_failures:
            counts.setdefault("correct", {})
            for kind, count in self._correctness_failures.items():
                counts["correct"][kind] = counts["correct"].get(kind, 0) + count
            self._correctness_failures.clear()
        return counts

    def correctness(
        self, completions: Sequence[str], rows: Sequence[dict], device: torch.device = CPU.device
    ) -> torch.Tensor:
        """Return the task's correctness per completion, (batch,) float32 on `device` (the accuracy metric).

        Never raises because of a completion, whatever ``on_error`` says: the accuracy metric is
        not a reward the user chose, so a checker failing on one completion scores it 0 and is
        counted as ``reward/correct/failures/<kind>`` (and logged) rather than ending the run.
        """
        _check_batch(completions, rows)
        errors: list[RewardFunctionError] = []
        column = _score_column("correct", self.task.correctness, completions, rows, errors, device)
        for error in errors:
            self._correctness_failures[error.kind] += 1
        if errors:
            logger.warning("accuracy check failed on %d completion(s), scored 0; first: %s", len(errors), errors[0])
        return column


__all__ = [
    "BUILTIN_REWARDS",
    "CHECKERS",
    "REWARDS",
    "RewardFn",
    "RewardFunctionError",
    "RewardSet",
    "answer_region",
    "callable_name",
    "checker",
    "exact_number",
    "exact_string",
    "extract_last_number",
    "extract_tagged_answer",
    "import_reward",
    "math_verify_answer",
    "parse_number",
    "r1_format",
    "register_reward",
    "resolve_reward",
    "tag_count",
]
