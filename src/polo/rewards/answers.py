"""Final-answer extraction and the correctness checks that tasks use.

Every checker has the reward signature ``(completion, row) -> float`` plus an
``answer_in_tags`` switch that task builders bind with ``functools.partial``:

- ``answer_in_tags=True``: only the content of the last ``<answer>...</answer>`` block counts;
  no block means 0.0, so the model is paid only for answers in the requested format.
- ``answer_in_tags=False``: the last answer block if there is one, else the whole completion.

Inside that region the numeric and math checkers grade one span, the final answer the reply
commits to (``final_answer_span``):

- the last commitment wins: the last ``\\boxed{...}``, "answer is ...", "answer: ...",
  "####" line, whichever comes last, so "\\boxed{17} ... wait ... \\boxed{18}" answers 18;
- a retraction after it ("wait", "actually", "no,", "oops", ...) followed by a new statement
  replaces it: "The answer is 18. Wait, no, it is 17." answers 17;
- with no commitment, the last statement holding a number or maths is the answer;
- a hedge between two different numbers ("17 or 18") is no answer;
- ``\\$18``, ``(18)``, ``−10`` (U+2212) and the mixed number ``2 1/2`` read as 18, 18, -10, 5/2.
"""

from __future__ import annotations

import bisect
import functools
import re
import textwrap
import threading
from collections.abc import Callable
from fractions import Fraction

from math_verify import parse, verify

from polo.core.registry import CHECKERS, register_checker, register_reward

# The last <answer> block; the tempered content pattern makes "<answer>a<answer>b</answer>"
# yield "b" rather than "a<answer>b".
_ANSWER_BLOCK = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)

# A number as people write final answers: optional minus, thousands separated by commas
# ("1,000", but not the list "1,2,3"), optional decimals. The lookbehind keeps "10-5" from
# reading as "-5" and stops a match from starting inside another number.
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")

# _NUMBER, optionally over a denominator ("5/2"): the value a final answer may be written as.
_VALUE = re.compile(_NUMBER.pattern + r"(?:/\d+(?!\.\d))?")

# The span extraction is ours, and math_verify only compares: math_verify reads a whole reply by
# its own priorities (any \boxed first; boxes close together merged into one set), so
# "\boxed{17} ... wait ... \boxed{18}" can come out as {17, 18} and "The answer is 17 or 18."
# as 17. It has no notion of the last answer a reply commits to, of a retraction or of a hedge.
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_PHRASE = re.compile(
    r"(?:\banswer\s*(?:is\b|:|=)\s*:?|\banswer\s+(?:should|would|must|will)\s+be\b|####)\s*", re.IGNORECASE
)
_RETRACTION = re.compile(
    r"\b(?:wait|actually|hmm+|oops|correction|mistake|sorry|on second thought|no,)"
    r"|\blet me re(?:check|calculate|consider|do|think|-)",
    re.IGNORECASE,
)
# A statement ends at a line break or at . ! ? ; before a space ("2.5" does not end one).
_STATEMENT_END = re.compile(r"[.!?;](?=\s|$)|\n")
# A statement can hold an answer if it has a digit, a LaTeX command or $-maths in it (a line
# that is only "$$" or "\\]" cannot).
_HOLDS_ANSWER = re.compile(r"\d|\\[A-Za-z(\[]|\$[^$]")
# "The answer is 18 (9 × 2)": a remark in brackets after a stated answer, whose numbers are not
# the answer. Spaced off, so "2(x+1)" is no remark; never taken from inside a box.
_TRAILING_REMARK = re.compile(r"\s+\([^()]*\)$")
_DISPLAY_DELIMITER = re.compile(r"\$\$|\\\[|\\\]")
_DISPLAY_CLOSER = {"$$": "$$", "\\[": "\\]"}
# Two numbers offered as alternatives ("17 or 18", "$17, or $18"): no grader takes either.
_HEDGE = re.compile(rf"({_VALUE.pattern})\s*,?\s*\bor\s+\$?\s*({_VALUE.pattern})")
# A whole number and a proper fraction side by side is a mixed number: "2 1/2" is 5/2, not 2.
_MIXED = re.compile(r"(?<![\d.,/])(-?)(\d+)\s+(\d+)\s*/\s*(\d+)(?![\d/])")
_LATEX_MIXED = re.compile(r"(?<![\d.,])(-?)(\d+)\s*\\[dt]?frac\{(\d+)\}\{(\d+)\}")
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")
_PARENTHESISED_NUMBER = re.compile(rf"\(\s*({_VALUE.pattern})\s*\)")
# Signs that mean "minus" in typeset or copied text; math_verify and Fraction want "-".
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})

# math_verify bounds its own parse/compare time with SIGALRM, which only the main thread may
# use; elsewhere we turn its timeout off (see _math_verify_timeout).
MATH_VERIFY_TIMEOUT_S = 5


def extract_tagged_answer(text: str) -> str | None:
    """Return the content of the last ``<answer>...</answer>`` block, or None if there is none."""
    blocks = _ANSWER_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def extract_last_number(text: str) -> str | None:
    """Return the last number in ``text``, thousands commas removed ("-1,250.5" -> "-1250.5")."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def parse_number(text: str) -> Fraction | None:
    """Return ``text`` as an exact Fraction if it is a plain number (commas allowed), else None."""
    cleaned = text.strip().replace(",", "")
    if not _NUMBER.fullmatch(cleaned):
        return None
    return Fraction(cleaned)


def answer_region(completion: str, answer_in_tags: bool) -> str | None:
    """Return the part of a completion that holds its final answer, or None if it has none.

    With ``answer_in_tags`` only an answer block qualifies; otherwise the answer block is
    preferred and the whole completion is the fallback.
    """
    tagged = extract_tagged_answer(completion)
    if tagged is not None or answer_in_tags:
        return tagged
    return completion


def _last_box(text: str) -> tuple[int, str, int] | None:
    """Return ``(start, content, end)`` of the last ``\\boxed{...}`` whose braces close, or None.

    Braces are paired in one pass (not one scan per box) so that a reply of many unclosed
    boxes costs linear time; a box cut off by the length limit commits to nothing.
    """
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    open_braces, closing = [], {}
    for brace in re.finditer(r"[{}]", text):
        if brace.group() == "{":
            open_braces.append(brace.start())
        elif open_braces:
            closing[open_braces.pop()] = brace.start()
    for box in reversed(boxes):
        close = closing.get(box.end() - 1)
        if close is not None:
            return box.start(), text[box.end() : close], close + 1
    return None


def _last_phrase(text: str) -> tuple[int, str, int] | None:
    """Return ``(start, statement, end)`` of the last "answer is ..." / "####" that states something.

    The statement runs from the phrase to the end of its sentence or to a retraction
    ("The answer is 18, wait, 17" states 18); a phrase followed by no number or maths ("the
    answer is below") commits to nothing. Positions are looked up by bisection so that a reply
    full of phrases costs n log n, not n².
    """

    def first_at_or_after(positions: list[int], at: int) -> int:
        index = bisect.bisect_left(positions, at)
        return positions[index] if index < len(positions) else len(text)

    statement_ends = [match.start() for match in _STATEMENT_END.finditer(text)]
    retractions = [match.start() for match in _RETRACTION.finditer(text)]
    answer_marks = [match.start() for match in _HOLDS_ANSWER.finditer(text)]
    for phrase in reversed(list(_ANSWER_PHRASE.finditer(text))):
        begin = phrase.end()
        end = min(first_at_or_after(statement_ends, begin), first_at_or_after(retractions, begin))
        if first_at_or_after(answer_marks, begin) < end:
            return phrase.start(), text[begin:end], end
    return None


def _join_display_math(text: str) -> str:
    """Return ``text`` with the line breaks inside ``$$...$$`` and ``\\[...\\]`` made spaces.

    A displayed answer is usually laid out on lines of its own ("$$", "\\frac{1}{2}", "$$"); a
    line break ends a statement, so without this the answer would be read as the line "$$".
    Same length out as in, so positions found in one are valid in the other; one pass.
    """
    pieces, opened, copied = [], None, 0
    for delimiter in _DISPLAY_DELIMITER.finditer(text):
        if opened is None:
            opened = delimiter if delimiter.group() in _DISPLAY_CLOSER else None
        elif delimiter.group() == _DISPLAY_CLOSER[opened.group()]:
            pieces += [text[copied : opened.start()], text[opened.start() : delimiter.end()].replace("\n", " ")]
            copied, opened = delimiter.end(), None
    return "".join(pieces) + text[copied:]


def _last_statement(text: str) -> str | None:
    """Return the last statement (sentence or line) holding a number or maths, else the last one."""
    statements = [piece.strip() for piece in _STATEMENT_END.split(text) if piece.strip()]
    holding = [piece for piece in statements if _HOLDS_ANSWER.search(piece)]
    return (holding or statements or [None])[-1]


def _normalize_span(span: str, boxed: bool = False) -> str:
    """Return a final-answer span rewritten so that both our reader and math_verify accept it."""
    span = span.translate(_MINUS_SIGNS).replace("\\$", "").replace("{,}", ",")
    span = span.strip().strip("*").strip().rstrip(".,;:!").lstrip(",;:").strip()
    without_remark = span if boxed else _TRAILING_REMARK.sub("", span)
    if _HOLDS_ANSWER.search(without_remark):
        span = without_remark
    span = _MIXED.sub(_mixed_as_fraction, span)
    span = _LATEX_MIXED.sub(lambda m: _mixed_as_fraction(m, latex=True), span)
    parenthesised = _PARENTHESISED_NUMBER.fullmatch(span)
    return parenthesised.group(1) if parenthesised else span


def _mixed_as_fraction(match: re.Match, latex: bool = False) -> str:
    """Return "2 1/2" as "5/2" (and "2\\frac{1}{2}" as "\\frac{5}{2}"); anything else unchanged."""
    sign, whole, numerator, denominator = match.groups()
    if max(len(whole), len(numerator), len(denominator)) > 100 or not 0 < int(numerator) < int(denominator):
        return match.group(0)  # "3 4/2" is no mixed number; a 100-digit one is nobody's answer
    improper = int(whole) * int(denominator) + int(numerator)
    return f"{sign}\\frac{{{improper}}}{{{denominator}}}" if latex else f"{sign}{improper}/{denominator}"


def final_answer_span(completion: str, answer_in_tags: bool = False) -> str | None:
    """Return the final answer the completion commits to, normalised, or None if it gives none.

    In the answer region (see ``answer_region``): the last commitment (``\\boxed{}``, "answer
    is", "answer:", "####"), unless a retraction follows it and a statement holding a number or
    maths follows the retraction, which then replaces it; with no commitment, the region's last
    statement holding a number or maths. A box's content comes back as ``\\boxed{...}`` so that
    math_verify reads it as it reads boxes. See the module docstring for examples.
    """
    region = answer_region(completion, answer_in_tags)
    if region is None:
        return None
    region = _join_display_math(region)
    commitments = [found for found in (_last_box(region), _last_phrase(region)) if found]
    if not commitments:
        span = _last_statement(region)
        return None if span is None else _normalize_span(span)
    start, span, end = max(commitments)
    retraction = _RETRACTION.search(region, end)
    restated = None if retraction is None else _last_statement(region[retraction.end() :])
    if restated is not None and _HOLDS_ANSWER.search(restated):
        return _normalize_span(restated)
    boxed = region.startswith("\\", start)  # phrases start with "answer" or "####"
    return f"\\boxed{{{_normalize_span(span, boxed=True)}}}" if boxed else _normalize_span(span)


def is_hedged(span: str) -> bool:
    """Return True if ``span`` offers two different numbers as alternatives ("17 or 18")."""
    return any(_fraction(a) != _fraction(b) for a, b in _HEDGE.findall(span))


def _fraction(value: str) -> Fraction | None:
    """Return a _VALUE match ("-1,250.5", "5/2") as a Fraction, or None if it is no number.

    None for a zero denominator, and for a number too long for Python's int conversion (over
    4300 digits): a model can write one, and grading must answer, not raise.
    """
    numerator, _, denominator = value.replace(",", "").partition("/")
    try:
        if denominator and int(denominator) == 0:
            return None
        return Fraction(numerator) / Fraction(denominator or 1)
    except ValueError:
        return None


def final_number(span: str) -> Fraction | None:
    """Return the number a final-answer span states (its last value), or None if none or hedged.

    ``\\frac{a}{b}`` with integers counts as a/b, so "\\boxed{\\frac{5}{2}}" states 5/2.
    """
    if is_hedged(span):
        return None
    values = _VALUE.findall(_LATEX_FRACTION.sub(r"\1/\2", span))
    return _fraction(values[-1]) if values else None


def exact_number(completion: str, row: dict, answer_in_tags: bool = False) -> float:
    """Return 1.0 if the completion's final number equals ``row["answer"]`` numerically, else 0.0.

    The final number is the one ``final_answer_span`` finds (``final_number``), so "<answer>The
    total is 85.0</answer>" and "\\boxed{84} ... wait ... \\boxed{85}" match the reference "85",
    and "84 or 85" matches nothing.
    """
    reference = parse_number(row["answer"])
    if reference is None:
        raise ValueError(
            f"exact_number needs a numeric reference answer, got {row['answer']!r}; "
            "use the 'math_verify' or 'exact_string' checker for other answers"
        )
    span = final_answer_span(completion, answer_in_tags)
    predicted = None if span is None else final_number(span)
    return float(predicted is not None and predicted == reference)


def exact_string(completion: str, row: dict, answer_in_tags: bool = False) -> float:
    """Return 1.0 if the answer region equals ``row["answer"]`` (strip, casefold), else 0.0."""
    region = answer_region(completion, answer_in_tags)
    if region is None:
        return 0.0
    return float(region.strip().casefold() == row["answer"].strip().casefold())


def _math_verify_timeout() -> int | None:
    """Return math_verify's timeout for this thread: seconds on the main thread, else None.

    math_verify enforces timeouts with signal.alarm, and Python refuses signal handlers off the
    main thread (math_verify then raises ValueError). Off the main thread we run without its
    timeout; callers that score from worker threads own the time limit there.
    """
    on_main_thread = threading.current_thread() is threading.main_thread()
    return MATH_VERIFY_TIMEOUT_S if on_main_thread else None


@functools.lru_cache(maxsize=8192)
def _parse_reference(answer: str, timeout: int | None) -> tuple:
    """Return math_verify's parse of a reference answer (cached: each row is scored G times)."""
    parsed = parse(answer, parsing_timeout=timeout)
    if not parsed:
        # Bare LaTeX such as "x+1" is only recognised inside math delimiters.
        parsed = parse(f"${answer}$", parsing_timeout=timeout)
    return tuple(parsed)


def math_verify_answer(completion: str, row: dict, answer_in_tags: bool = False) -> float:
    """Return 1.0 if math_verify finds the completion's answer equal to ``row["answer"]``, else 0.0.

    The completion's side is its ``final_answer_span`` only (a hedge between two numbers scores
    0.0 unless the reference is written that way too). Both sides go through
    ``math_verify.parse`` and are compared with ``math_verify.verify``, so
    "0.5", "1/2" and "$\\frac{1}{2}$" all match the reference "1/2". Unparseable text scores 0.0:
    with ``raise_on_error=False`` (the default we rely on) math_verify itself turns parse and
    comparison failures and timeouts into "no match", so there is nothing here to catch.
    Safe to call from any thread (see ``_math_verify_timeout``).
    """
    span = final_answer_span(completion, answer_in_tags)
    if span is None or (is_hedged(span) and not is_hedged(row["answer"])):
        return 0.0
    timeout = _math_verify_timeout()
    reference = _parse_reference(row["answer"], timeout)
    predicted = parse(span, parsing_timeout=timeout)
    if not reference or not predicted:
        return 0.0
    return float(verify(list(reference), predicted, timeout_seconds=timeout))


@register_reward("correct", per_task=True, help="the task's own correctness check, 1 or 0")
def task_correctness(task) -> Callable[[str, dict], float]:
    """Return the task's own correctness function (the ``"correct"`` reward: the task's checker decides)."""
    return task.correctness


# The answer checkers the jsonl and hf tasks' ``checker`` option accepts, each with what it counts as
# right: the registry that validation, `polo train --help`, `polo config` and the README's table follow.
register_checker(
    "math_verify",
    help='the final answer equals the reference as maths, in any notation ("0.5", "1/2", "$\\frac{1}{2}$", '
    '"\\boxed{1/2}"); any reference math-verify can parse (numbers, fractions, LaTeX expressions)',
)(math_verify_answer)
register_checker(
    "exact_number",
    help='the final number equals the reference numerically ("85", "85.0", "1,000" for 1000); '
    "every reference must be a plain number, checked when the data loads",
)(exact_number)
register_checker(
    "exact_string",
    help="the answer (the last <answer> block, else the whole completion) equals the reference as text, "
    "ignoring case and surrounding spaces; for short text answers",
)(exact_string)
DEFAULT_CHECKER = "math_verify"  # the jsonl and hf tasks' default (TaskConfig.checker)


def checker_help(indent: str = "  ", width: int = 100) -> str:
    """Return "name: what it accepts" per checker, the default marked, wrapped to ``width`` (`polo train --help`)."""
    return "\n".join(
        textwrap.fill(
            f"{name}{' (default)' if name == DEFAULT_CHECKER else ''}: {accepts}",
            width,
            initial_indent=indent,
            subsequent_indent=indent * 3,
        )
        for name, accepts in ((entry.name, entry.help) for entry in CHECKERS.entries())
    )


def checker(name: str, answer_in_tags: bool = False) -> Callable[[str, dict], float]:
    """Return the named correctness checker with ``answer_in_tags`` bound."""
    if name not in CHECKERS:
        raise ValueError(CHECKERS.unknown(name))
    return functools.partial(CHECKERS[name], answer_in_tags=answer_in_tags)
