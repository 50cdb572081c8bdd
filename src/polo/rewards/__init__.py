"""Reward functions and their weighted combination.

A reward is any plain function ``(completion: str, row: dict) -> float``, or a *batched* one:
a callable with the attribute ``batched = True`` that takes ``(completions, rows)`` and returns
one float per completion (a learned reward model scores a whole batch in one forward pass), or
a function in TRL's form ``(prompts, completions, completion_ids, **columns) -> list[float | None]``,
told apart by its signature (`polo.rewards.forms`).
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
from dataclasses import dataclass
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
from polo.rewards.forms import RewardProgress, TrlReward, reward_caller
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


# The largest finite float32: rewards are added up and normalised in float32, where a larger value is inf.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class RewardBatch:
    """What a reward function is called on: completions, one row each, and (for TRL-form rewards) the sampled token
    ids and the run's progress (`polo.rewards.forms`)."""

    completions: Sequence[str]
    rows: Sequence[dict]
    completion_ids: Sequence[Sequence[int]] | None = None
    progress: RewardProgress = RewardProgress()

    def one(self, index: int) -> RewardBatch:
        """Return the batch of sample `index` alone."""
        ids = None if self.completion_ids is None else [self.completion_ids[index]]
        return RewardBatch([self.completions[index]], [self.rows[index]], ids, self.progress)


def _checked_value(value: object, name: str, index: int, completion: str, allow_none: bool = False) -> float:
    """Return a reward value as float (None as NaN where `allow_none`: TRL's "does not apply to this sample"), or
    raise RewardFunctionError if it is not a number finite in float32."""
    if value is None and allow_none:
        return math.nan
    if not isinstance(value, numbers.Real):
        accepted = "a float or None" if allow_none else "a float"
        raise RewardFunctionError(
            name,
            index,
            completion,
            f"returned {type(value).__name__} {value!r:.80}, expected {accepted}",
            "not_a_number",
        )
    if not math.isfinite(value):
        raise RewardFunctionError(name, index, completion, f"returned non-finite value {value!r}", "non_finite")
    if abs(float(value)) > _FLOAT32_MAX:
        raise RewardFunctionError(
            name,
            index,
            completion,
            f"returned {value!r}, which is not finite in float32, where rewards are summed and normalised "
            f"(largest {_FLOAT32_MAX:.4g})",
            "non_finite",
        )
    return float(value)


def _is_batch_function(function: Callable) -> bool:
    """Return True for a function called once per batch: polo's batched form or TRL's."""
    return isinstance(function, TrlReward) or bool(getattr(function, "batched", False))


def _batch_call(function: Callable, batch: RewardBatch) -> list:
    """Return a batch function's values for `batch`, unchecked."""
    if isinstance(function, TrlReward):
        return _as_list(function(batch.completions, batch.rows, batch.completion_ids, batch.progress))
    return _as_list(function(list(batch.completions), list(batch.rows)))


def _score_column(
    name: str,
    function: RewardFn,
    batch: RewardBatch,
    errors: list[RewardFunctionError] | None = None,
    device: torch.device = CPU.device,
) -> torch.Tensor:
    """Return one reward function's values for the batch, shape (batch,) float32 on `device` (NaN: None, "does not
    apply", from a TRL-form function).

    A sample whose function raises (or returns a non-number, or one not finite in float32) stops the
    batch with `RewardFunctionError`, unless `errors` is a list: then it scores 0 and its error is
    appended there. A batch function (polo's ``batched = True`` or TRL's form) is called once for the
    whole batch; if that call raises, it is called again one sample at a time, so the error still
    names the sample that failed. Returning the wrong number of values always raises.
    """
    allow_none = isinstance(function, TrlReward)
    batch_values = _batched_values(name, function, batch) if _is_batch_function(function) else None
    values = []
    for index, completion in enumerate(batch.completions):
        try:
            if batch_values is not None:
                values.append(_checked_value(batch_values[index], name, index, completion, allow_none))
            else:
                values.append(_sample_reward(name, _sample_call(function, batch, index), index, completion, allow_none))
        except RewardFunctionError as error:
            if errors is None:
                raise
            errors.append(error)
            values.append(0.0)
    return torch.tensor(values, dtype=torch.float32, device=device)


def _sample_call(function: Callable, batch: RewardBatch, index: int) -> Callable[[], object]:
    """Return the call that scores sample `index` alone: polo's `function(completion, row)`, or a batch function on a
    batch of one (after its call on the whole batch raised, so that the error names the sample)."""
    if _is_batch_function(function):
        return functools.partial(_single_value, function, batch.one(index))
    return functools.partial(function, batch.completions[index], batch.rows[index])


def _sample_reward(name: str, call: Callable[[], object], index: int, completion: str, allow_none: bool) -> float:
    """Return `call()`, sample `index`'s value, checked; anything it raises (a `sys.exit` too) becomes a
    `RewardFunctionError` for this sample.

    Only a stop request (Ctrl-C, `KeyboardInterrupt`) goes through, and `SandboxError`, which says the
    machine cannot run the sandbox at all: no completion caused it.
    """
    try:
        value = call()
    except (SandboxError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # SystemExit too: a reward that exits must not end the run as a success
        raise RewardFunctionError(name, index, completion, _raised(exc), type(exc).__name__) from exc
    return _checked_value(value, name, index, completion, allow_none)


def _raised(error: BaseException) -> str:
    """Return what a reward raised, in words (a `sys.exit` said as such: it is not an error type a reader expects)."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r}), which a reward must not: return a value instead"
    return f"{type(error).__name__}: {error}"


def _as_list(values: object) -> list:
    """Return a batched function's result as a list (tensors and arrays become Python numbers)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return list(values)


def _batched_values(name: str, function: Callable, batch: RewardBatch) -> list | None:
    """Return a batch function's values for the whole batch, or None if the call raised.

    A wrong number of values is a bug of the function rather than of a sample: it always raises
    `RewardFunctionError`, naming the first sample left without a value.
    """
    completions = batch.completions
    try:
        values = _batch_call(function, batch)
    except KeyboardInterrupt:
        raise
    except BaseException:  # rescored per sample by the caller, which names the failing sample
        return None
    if len(values) != len(completions):
        index = min(len(values), len(completions) - 1)
        raise RewardFunctionError(
            name,
            index,
            completions[index],
            f"returned {len(values)} values for {len(completions)} completions (one per completion, in order)",
        )
    return values


def _single_value(function: Callable, batch: RewardBatch) -> object:
    """Return a batch function's value for a batch of one sample."""
    values = _batch_call(function, batch)
    if len(values) != 1:
        raise ValueError(f"returned {len(values)} values for 1 completion")
    return values[0]


def _is_finite_number(value: object) -> bool:
    """Return True for a finite real number that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def _check_total(
    total: torch.Tensor, columns: dict[str, torch.Tensor], weights: dict[str, float], completions: Sequence[str]
) -> None:
    """Raise RewardFunctionError naming the first sample whose weighted total overflowed float32 (each value was
    finite; weight times value, or their sum, was not)."""
    overflowed = (~torch.isfinite(total)).nonzero()
    if not len(overflowed):
        return
    index = int(overflowed[0])
    terms = " + ".join(f"{weights[name]:g} * {float(column[index]):g} ({name})" for name, column in columns.items())
    raise RewardFunctionError(
        "+".join(columns),
        index,
        completions[index],
        f"the weighted total {terms} is not finite in float32",
        "non_finite",
    )


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
        # How many samples of the last `score` call no reward applied to (every TRL-form reward returned None).
        self.last_unscorable = 0
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
            self._functions[name] = reward_caller(function, name, task.train_rows)
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
        completion_ids: Sequence[Sequence[int]] | None = None,
        progress: RewardProgress | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return the weighted total (batch,) float32 and each reward's raw values (batch,), on `device`.

        ``total[i] = sum_k weight_k * reward_k(completions[i], rows[i])`` over the rewards that apply
        to sample i: a TRL-form reward's None is NaN in its column and left out of the sum, as TRL's
        ``GRPOTrainer`` leaves it (a sample no reward applies to totals 0, and is counted in
        ``last_unscorable``). ``completion_ids`` (the sampled tokens of each completion) and
        ``progress`` reach TRL-form rewards only. With ``on_error="zero"`` a failing sample scores 0
        for that function and the error is kept in ``last_errors``; otherwise the first failure
        raises `RewardFunctionError`, as does a total that is not finite in float32.
        """
        _check_batch(completions, rows)
        self.last_errors = []
        errors = self.last_errors if self.on_error == "zero" else None
        batch = RewardBatch(completions, rows, completion_ids, progress or RewardProgress())
        columns = {
            name: _score_column(name, function, batch, errors, device) for name, function in self._functions.items()
        }
        total = torch.zeros(len(completions), dtype=torch.float32, device=device)
        applied = torch.zeros(len(completions), dtype=torch.bool, device=device)
        for name, column in columns.items():
            total += self._weights[name] * torch.nan_to_num(column, nan=0.0)
            applied |= ~column.isnan()
        self.last_unscorable = int((~applied).sum())
        _check_total(total, columns, self._weights, completions)
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
        column = _score_column("correct", self.task.correctness, RewardBatch(completions, rows), errors, device)
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
