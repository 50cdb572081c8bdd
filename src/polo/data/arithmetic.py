"""Generated integer arithmetic ("What is 47 + 38?"): the smallest task that shows RL learning."""

from __future__ import annotations

import functools
import itertools
import operator
import random
from collections.abc import Callable, Sequence

from polo.core.registry import register_task
from polo.data.base import Task, default_instruction
from polo.rewards.answers import exact_number

OPERATIONS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}

Problem = tuple[int, str, int]


def operand_range(digits: int) -> range:
    """Return the integers with exactly ``digits`` digits (1 digit includes 0)."""
    return range(0, 10) if digits == 1 else range(10 ** (digits - 1), 10**digits)


def count_problems(operators: Sequence[str], min_digits: int, max_digits: int) -> int:
    """Return how many distinct (a, operator, b) problems the settings allow."""
    operands = sum(len(operand_range(d)) for d in range(min_digits, max_digits + 1))
    return len(operators) * operands * operands


def _draw_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    """Return an operand whose digit count is uniform in [min_digits, max_digits]."""
    # Digit count first, then the value: otherwise nearly every operand would have max_digits.
    return rng.choice(operand_range(rng.randint(min_digits, max_digits)))


def _sample_distinct(
    rng: random.Random, count: int, operators: Sequence[str], min_digits: int, max_digits: int
) -> list[Problem]:
    """Return ``count`` distinct problems by drawing until enough new ones have appeared."""
    problems: dict[Problem, None] = {}  # a dict keeps draw order, so results are reproducible
    while len(problems) < count:
        a = _draw_operand(rng, min_digits, max_digits)
        op = rng.choice(operators)
        b = _draw_operand(rng, min_digits, max_digits)
        problems.setdefault((a, op, b), None)
    return list(problems)


def _enumerate_and_sample(
    rng: random.Random, count: int, operators: Sequence[str], min_digits: int, max_digits: int
) -> list[Problem]:
    """Return ``count`` distinct problems sampled uniformly from the full enumerated space."""
    operands = [n for d in range(min_digits, max_digits + 1) for n in operand_range(d)]
    return rng.sample(list(itertools.product(operands, operators, operands)), count)


def draw_problems(seed: int, count: int, operators: Sequence[str], min_digits: int, max_digits: int) -> list[Problem]:
    """Return ``count`` distinct (a, operator, b) problems, deterministic in ``seed``."""
    rng = random.Random(seed)
    space = count_problems(operators, min_digits, max_digits)
    # Rejection sampling keeps the per-digit-count distribution but slows down like a coupon
    # collector as the request nears the whole space; past half of it, enumerating is cheaper
    # (and the space is then small enough to enumerate).
    sampler = _enumerate_and_sample if 2 * count > space else _sample_distinct
    return sampler(rng, count, operators, min_digits, max_digits)


def problem_row(problem: Problem) -> dict:
    """Return the task row for one problem."""
    a, op, b = problem
    return {
        "question": f"What is {a} {op} {b}?",
        "answer": str(OPERATIONS[op](a, b)),
        "operands": [a, b],
        "operator": op,
    }


def _check_settings(operators: Sequence[str], min_digits: int, max_digits: int, num_train: int, num_eval: int) -> None:
    """Raise ValueError naming the first setting outside what the generator accepts."""
    if isinstance(operators, str) or not operators:
        raise ValueError(f"operators must be a non-empty list such as ['+', '-'], got {operators!r}")
    unknown = [op for op in operators if op not in OPERATIONS]
    if unknown:
        raise ValueError(f"unknown operators {unknown}; valid operators: {list(OPERATIONS)}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got min_digits={min_digits}, max_digits={max_digits}")
    for label, size in (("num_train", num_train), ("num_eval", num_eval)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{label} must be an integer >= 0, got {size!r}")


@register_task("arithmetic", help="problems generated from a seed")
def arithmetic_task(
    seed: int = 0,
    operators: Sequence[str] = ("+",),
    min_digits: int = 2,
    max_digits: int = 2,
    num_train: int = 5000,
    num_eval: int = 200,
    answer_in_tags: bool = False,
) -> Task:
    """Return a generated arithmetic Task with disjoint train and eval problems.

    Each operand's digit count is uniform in [min_digits, max_digits]; "-" may give negative
    answers. Eval problems are drawn first, so the eval split for a seed stays the same when
    only ``num_train`` changes (as long as the request stays under half the problem space).
    Correctness is an exact integer match (``exact_number``).
    """
    _check_settings(operators, min_digits, max_digits, num_train, num_eval)
    operators = list(dict.fromkeys(operators))  # repeated operators would only skew the mix
    space = count_problems(operators, min_digits, max_digits)
    needed = num_train + num_eval
    if needed > space:
        raise ValueError(
            f"arithmetic task needs {needed} distinct problems (num_train={num_train} + "
            f"num_eval={num_eval}) but operators {operators} with {min_digits}-{max_digits} digit "
            f"operands allow only {space}; lower the counts or widen the digits/operators"
        )
    problems = draw_problems(seed, needed, operators, min_digits, max_digits)
    return Task(
        name="arithmetic",
        train_rows=[problem_row(p) for p in problems[num_eval:]],
        eval_rows=[problem_row(p) for p in problems[:num_eval]],
        correctness=functools.partial(exact_number, answer_in_tags=answer_in_tags),
        instruction=default_instruction(answer_in_tags),
    )
