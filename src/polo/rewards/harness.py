"""The program the ``code`` reward runs in the sandbox: a completion's code, then each test's setup and leaves.

``polo.rewards.code.harness_program`` reads this file's text (through importlib.resources) and
appends one call, ``main(marker, solution, tests, max_repr)`` with the values written as literals;
the sandbox runs the whole as its program. Results go to a private copy of stdout, one JSON line
each behind the per-run marker; the solution's own prints go to stderr. Nothing it reports can
pass a test by itself: a test's verdict is computed in the parent from the leaf values
(polo.rewards.code and polo.rewards.judge), so a forged line can at most claim values, which are only right if the
program computed them.

Inside the sandbox only the standard library exists, so this module imports nothing else
(tests/rewards checks it). Importing it runs nothing: the tests call `run` in-process.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

# Every compile() here passes dont_inherit=True: the code it compiles must not take this module's
# `from __future__ import annotations`, so that it runs as it would on its own.
# Taken before the solution runs, which may replace the builtins (the parent judges all the same).
_repr, _str, _type, _len = repr, str, type, len

Send = Callable[..., None]


def describe(exc: BaseException) -> str:
    """Return "Type: message" for an exception, cut to 300 characters (the type alone if its text raises)."""
    try:
        return f"{_type(exc).__name__}: {exc}"[:300]
    except BaseException:
        return _type(exc).__name__


def leaf_entry(scope: dict, leaf: str, index: int, max_repr: int) -> list[str]:
    """Return ``["value", repr]`` for one leaf evaluated in ``scope``, or ``["error", why]``."""
    try:
        text = _repr(eval(compile(leaf, f"test_{index}", "eval", dont_inherit=True), scope))
    except BaseException as exc:
        return ["error", describe(exc)]
    if _type(text) is not _str or _len(text) > max_repr:
        return ["error", f"result repr longer than {max_repr} characters"]
    return ["value", text]


def run_test(namespace: dict, index: int, setup: list[str], leaves: list[str], max_repr: int) -> dict:
    """Return the report of one test: its leaves' entries, or the error its setup raised.

    A test with setup statements runs them in a copy of the solution's namespace, so that one
    test's setup cannot change what the next test sees.
    """
    scope = dict(namespace) if setup else namespace
    try:
        for line in setup:
            exec(compile(line, f"test_{index}", "exec", dont_inherit=True), scope)
    except BaseException as exc:
        return {"test": index, "setup_error": describe(exc)}
    return {"test": index, "leaves": [leaf_entry(scope, leaf, index, max_repr) for leaf in leaves]}


def run(solution: str, tests: list[tuple[list[str], list[str]]], send: Send, max_repr: int) -> None:
    """Run ``solution``, then each (setup, leaves) test, passing every report to ``send(**fields)``.

    The first report says whether the solution ran (``solution="ok"``, or its exception's type);
    when it raised, no test runs.
    """
    namespace = {"__name__": "solution"}
    try:
        exec(compile(solution, "solution.py", "exec", dont_inherit=True), namespace)
    except BaseException as exc:
        send(solution=_type(exc).__name__, detail=describe(exc))
        return
    send(solution="ok", detail="")
    for index, (setup, leaves) in enumerate(tests):
        send(**run_test(namespace, index, setup, leaves, max_repr))


def main(marker: str, solution: str, tests: list[tuple[list[str], list[str]]], max_repr: int) -> None:
    """Run the harness in the sandbox: reports on the original stdout, the solution's output on stderr."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(**fields: object) -> None:
        results.write(marker + json.dumps(fields) + "\n")

    run(solution, tests, send, max_repr)
    sys.stdout.flush()
    # Straight out: no atexit handler or thread the solution left behind runs, or holds the exit.
    os._exit(0)
