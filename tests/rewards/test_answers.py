"""Grading as a careful grader would: the final answer is the last one a completion commits to.

Each case of issue 20's "Grading" paragraph is here with the score it had before (in the
comment) and the score it must have now, for both numeric checkers: `exact_number` and
`math_verify_answer` (GSM8K's checker).
"""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from polo.rewards.answers import (
    exact_number,
    final_answer_span,
    final_number,
    is_hedged,
    math_verify_answer,
)

CHECKERS = [exact_number, math_verify_answer]

# (completion, reference, expected score, the old scores as exact_number / math_verify_answer)
ISSUE_CASES = [
    ("The answer is \\$18.", "18", 1.0),  # old 1 / 0
    ("<answer>\\$18</answer>", "18", 1.0),  # old 1 / 0
    ("\\$18", "18", 1.0),  # old 1 / 0
    ("(18)", "18", 1.0),  # old 1 / 0
    ("The answer is (18).", "18", 1.0),  # old 1 / 0
    ("\u221210", "-10", 1.0),  # U+2212 minus; old 0 / 0
    ("The answer is \u221210.", "-10", 1.0),  # old 0 / 0
    ("2 1/2", "2.5", 1.0),  # old 0 / 0
    ("The answer is 2 1/2.", "2.5", 1.0),  # old 0 / 0
    ("\\boxed{17}. Wait, actually \\boxed{18}", "18", 1.0),  # old 1 / 0 (math_verify read {17, 18})
    ("The answer is \\boxed{17}. Hmm, wait. Recount: the answer is \\boxed{18}.", "18", 1.0),  # old 1 / 0
    ("\\boxed{17} ... wait ... \\boxed{18}", "18", 1.0),  # old 1 / 1
    ("The answer is 18. Wait, no, it is 17.", "18", 0.0),  # old 0 / 1
    ("The answer is 18. Wait, no, it is 17.", "17", 1.0),  # old 1 / 0
    ("17 or 18", "18", 0.0),  # old 1 / 1
    ("The answer is 17 or 18.", "18", 0.0),  # old 1 / 0
    ("The answer is 17 or 18.", "17", 0.0),  # old 0 / 1
]


@pytest.mark.parametrize("check", CHECKERS, ids=lambda check: check.__name__)
@pytest.mark.parametrize(("completion", "reference", "expected"), ISSUE_CASES)
def test_issue_20_grading_cases(check, completion, reference, expected):
    assert check(completion, {"answer": reference}) == expected


@pytest.mark.parametrize("check", CHECKERS, ids=lambda check: check.__name__)
@pytest.mark.parametrize(
    ("completion", "answer_in_tags", "expected"),
    [
        ("<answer>\\$18</answer>", True, 1.0),
        ("<think>17? no</think><answer>The total is \\$18.00</answer>", True, 1.0),
        ("<answer>17 or 18</answer>", True, 0.0),
        ("<answer>\\boxed{17} wait \\boxed{18}</answer>", True, 1.0),
        ("The answer is 18.", True, 0.0),  # tags required and absent
    ],
)
def test_the_same_rules_apply_inside_answer_tags(check, completion, answer_in_tags, expected):
    assert check(completion, {"answer": "18"}, answer_in_tags=answer_in_tags) == expected


@pytest.mark.parametrize("check", CHECKERS, ids=lambda check: check.__name__)
@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        # What was right stays right.
        ("47 + 38 = 85", 1.0),
        ("So the answer is 85.", 1.0),
        ("So the answer is $\\boxed{85}$", 1.0),
        ("She has 40 + 45 = <<40+45=85>>85 apples.\n#### 85", 1.0),  # GSM8K's own format
        ("I get 84 then correct to 85", 1.0),  # no commitment: the last statement's number
        # A check after the answer does not move it; a wrong number after the answer does not either.
        ("The answer is 85. Check: 85 - 38 = 47, and 47 + 38 = 85.", 1.0),
        ("The answer is 85. That is 5 more than 80.", 1.0),
        ("The answer is \\boxed{85}. Wait, let me make sure that is right. Yes.", 1.0),  # nothing restated
        ("\\boxed{85}. Hmm, actually 47 + 38 = 84, so it is 84.", 0.0),  # restated after a retraction
        ("The answer is below.\n47 + 38 = 85", 1.0),  # "answer is" + no number commits to nothing
        ("\\boxed{84} and then \\boxed{85", 0.0),  # a cut-off box commits to nothing: 84 stands
        ("The final answer is $85$. I hope it is correct.", 1.0),
        ("**Answer:** 85", 1.0),
        ("The answer is 85 or 85.0", 1.0),  # the same value twice is no hedge
        ("The answer is 85 (47 + 38).", 1.0),  # a spaced-off remark after the answer is no answer
        ("The answer is:\n\n$$\n85\n$$", 1.0),  # displayed maths over several lines
        ("So\n\\[\n x = 85\n\\]", 1.0),
        ("either 84 or 85", 0.0),
        ("", 0.0),
    ],
)
def test_commitments_retractions_and_what_stays_right(check, completion, expected):
    assert check(completion, {"answer": "85"}) == expected


@pytest.mark.parametrize("check", CHECKERS, ids=lambda check: check.__name__)
@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        ("The answer is \\$1,250.50.", "1250.5"),
        ("\\boxed{\\frac{5}{2}}", "2.5"),
        ("$2\\frac{1}{2}$", "2.5"),
        ("The answer is -3 1/4", "-3.25"),
        ("\\boxed{\u22127}", "-7"),
        ("It costs ( 12 ).", "12"),
    ],
)
def test_written_forms_of_a_number_parse(check, completion, reference):
    assert check(completion, {"answer": reference}) == 1.0


def test_a_box_keeps_its_brackets():
    assert final_answer_span("\\boxed{2 (x+1)}") == "\\boxed{2 (x+1)}"
    assert math_verify_answer("\\boxed{2(x+1)}", {"answer": "$2x+2$"}) == 1.0


def test_math_verify_accepts_a_hedge_only_when_the_reference_is_one():
    assert math_verify_answer("x is 2 or 3", {"answer": "2 or 3"}) == 1.0
    assert math_verify_answer("x is 2 or 3", {"answer": "2"}) == 0.0


@pytest.mark.parametrize(
    ("completion", "span"),
    [
        ("The answer is \\$18.", "18"),
        ("\\boxed{17} ... wait ... \\boxed{18}", "\\boxed{18}"),
        ("The answer is 18. Wait, no, it is 17.", "no, it is 17"),
        ("The answer is 18, wait, 17", "17"),  # a retraction also ends the committed statement
        ("(18)", "18"),
        ("2 1/2", "5/2"),
        ("\u221210", "-10"),
        ("no digits at all", "no digits at all"),
        ("", None),
    ],
)
def test_final_answer_span(completion, span):
    assert final_answer_span(completion) == span


def test_final_number_and_hedges():
    assert final_number("5/2") == Fraction(5, 2)
    assert final_number("\\boxed{\\frac{1}{3}}") == Fraction(1, 3)
    assert final_number("5/0") is None
    assert final_number("17 or 18") is None
    assert final_number("1" * 5000) is None  # longer than Python converts: no answer, no exception
    assert is_hedged("\\$17 or \\$18".replace("\\$", "$")) and not is_hedged("18 or 18.00")
    assert not is_hedged("x = 2 or x = 3")  # alternatives as equations are left to math_verify


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{" * 20_000,
        "the answer is " * 10_000,
        "The answer is 5 wait " * 5_000,
        "1 or " * 20_000,
        "1" * 100_000,
    ],
)
def test_hostile_completions_are_graded_quickly_without_raising(completion):
    started = time.perf_counter()
    assert exact_number(completion, {"answer": "5"}) in (0.0, 1.0)
    assert time.perf_counter() - started < 5.0  # linear time: a quadratic scan takes minutes here
