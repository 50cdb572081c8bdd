"""Final-answer extraction and the correctness checks that tasks use.

Every checker has the reward signature ``(completion, row) -> float`` plus an
``answer_in_tags`` switch that task builders bind with ``functools.partial``:

- ``answer_in_tags=True``: only the content of the last ``<answer>...</answer>`` block counts;
  no block means 0.0, so the model is paid only for answers in the requested format.
- ``answer_in_tags=False``: the last answer block if there is one, else the whole completion.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from fractions import Fraction

from math_verify import parse, verify

# The last <answer> block; the tempered content pattern makes "<answer>a<answer>b</answer>"
# yield "b" rather than "a<answer>b".
_ANSWER_BLOCK = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)

# A number as people write final answers: optional minus, thousands separated by commas
# ("1,000", but not the list "1,2,3"), optional decimals. The lookbehind keeps "10-5" from
# reading as "-5" and stops a match from starting inside another number.
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")

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


def exact_number(completion: str, row: dict, answer_in_tags: bool = False) -> float:
    """Return 1.0 if the completion's final number equals ``row["answer"]`` numerically, else 0.0.

    The final number is the last number in the answer region (see ``answer_region``), so
    "<answer>The total is 85.0</answer>" matches the reference "85".
    """
    reference = parse_number(row["answer"])
    if reference is None:
        raise ValueError(
            f"exact_number needs a numeric reference answer, got {row['answer']!r}; "
            "use the 'math_verify' or 'exact_string' checker for other answers"
        )
    region = answer_region(completion, answer_in_tags)
    predicted = None if region is None else extract_last_number(region)
    return float(predicted is not None and Fraction(predicted) == reference)


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

    Both sides go through ``math_verify.parse`` and are compared with ``math_verify.verify``, so
    "0.5", "1/2" and "$\\frac{1}{2}$" all match the reference "1/2". Unparseable text scores 0.0:
    with ``raise_on_error=False`` (the default we rely on) math_verify itself turns parse and
    comparison failures and timeouts into "no match", so there is nothing here to catch.
    Safe to call from any thread (see ``_math_verify_timeout``).
    """
    region = answer_region(completion, answer_in_tags)
    if region is None:
        return 0.0
    timeout = _math_verify_timeout()
    reference = _parse_reference(row["answer"], timeout)
    predicted = parse(region, parsing_timeout=timeout)
    if not reference or not predicted:
        return 0.0
    return float(verify(list(reference), predicted, timeout_seconds=timeout))


# Names accepted by the jsonl task's ``checker`` option.
CHECKERS: dict[str, Callable[..., float]] = {
    "math_verify": math_verify_answer,
    "exact_number": exact_number,
    "exact_string": exact_string,
}


def checker(name: str, answer_in_tags: bool = False) -> Callable[[str, dict], float]:
    """Return the named correctness checker with ``answer_in_tags`` bound."""
    if name not in CHECKERS:
        raise ValueError(f"unknown checker {name!r}; valid checkers: {sorted(CHECKERS)}")
    return functools.partial(CHECKERS[name], answer_in_tags=answer_in_tags)
