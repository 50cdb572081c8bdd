"""The ``code`` reward: the fraction of a row's tests that the completion's Python code passes.

Which code is run (``extract_code``): the last fenced block tagged ``python``/``py``/``python3``;
else the last fenced block of any language; else the whole completion. A fence cut off by the
token limit (no closing ```) runs to the end of the text.

A row's ``"tests"`` is a list of Python ``assert`` statements. A test of the form
``assert <expression> == <literal>`` (every test of the built-in task) is a *value test*: only
the expression goes into the sandbox, its result comes back as ``repr`` and is compared with the
literal here, in the parent, so a program cannot fake a pass without computing the right value.
Any other assert is a *statement test*, run inside the sandbox, passing when it raises nothing
(weaker: code that tampers with the interpreter could fake it).

Every failure has a reason (``CodeResult.reason``, one per test in ``CodeResult.tests``); the
reward object counts reasons by kind in ``CodeReward.failure_counts`` and logs each at DEBUG.
"""

from __future__ import annotations

import ast
import collections
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from polo.sandbox.runner import SandboxLimits, SandboxResult, run_python

logger = logging.getLogger(__name__)

# Short programs: generous for the built-in task, small enough that a batch of infinite loops
# costs seconds, not minutes.
DEFAULT_LIMITS = SandboxLimits(timeout_s=3.0, memory_bytes=512 * 2**20, max_output_bytes=64 * 2**10)
_MAX_RESULT_REPR = 10_000
_CACHE_SIZE = 2048

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_code(completion: str) -> str:
    """Return the code to run: the last ```python block, else the last ``` block, else the text."""
    blocks = [(match.group(1).lower(), match.group(2)) for match in _FENCE.finditer(completion)]
    python_blocks = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python_blocks:
        return python_blocks[-1]
    if blocks:
        return blocks[-1][1]
    return completion


@dataclass(frozen=True)
class TestOutcome:
    """One test's verdict: ``kind`` is "pass", "wrong_answer", "error", "not_run" or a run status."""

    index: int
    passed: bool
    kind: str
    reason: str


@dataclass
class CodeResult:
    """The outcome of running one completion against its tests."""

    passed: int
    total: int
    tests: list[TestOutcome]
    reason: str
    sandbox: SandboxResult | None = None
    failure_kinds: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        """Return passed / total (0.0 when there are no tests)."""
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        """Return True when every test passed (and there was at least one)."""
        return self.total > 0 and self.passed == self.total


@dataclass(frozen=True)
class _Test:
    """A parsed test: a value test has ``expression`` and ``expected``; else ``statement``."""

    source: str
    expression: str | None = None
    expected: object = None
    statement: str | None = None


def parse_test(test: str) -> _Test:
    """Return the parsed form of one assert test (a value test when it compares with a literal)."""
    if not isinstance(test, str):
        raise ValueError(f"a test must be a string holding an assert statement, got {test!r}")
    try:
        tree = ast.parse(test)
    except SyntaxError as exc:
        raise ValueError(f"test {test!r} is not valid Python: {exc.msg}") from exc
    node = tree.body[0] if len(tree.body) == 1 else None
    if (
        isinstance(node, ast.Assert)
        and isinstance(node.test, ast.Compare)
        and len(node.test.ops) == 1
        and isinstance(node.test.ops[0], ast.Eq)
    ):
        try:
            expected = ast.literal_eval(node.test.comparators[0])
        except ValueError:
            pass
        else:
            return _Test(test, expression=ast.unparse(node.test.left), expected=expected)
    return _Test(test, statement=test)


# The program sent to the sandbox. Results go to a private copy of stdout, one line each, behind
# a per-run marker; the solution's own prints are sent to stderr (capped like everything else).
_HARNESS = """\
import os as _os, sys as _sys
_results = _os.fdopen(_os.dup(1), "w", buffering=1)
_os.dup2(2, 1)
def _report(*fields):
    _results.write({marker!r} + repr(fields) + "\\n")
_namespace = {{"__name__": "solution"}}
try:
    exec(compile({solution!r}, "solution.py", "exec"), _namespace)
except BaseException as _exc:
    _report("solution", type(_exc).__name__, str(_exc)[:300])
    _os._exit(0)
_report("solution", "ok", "")
for _index, (_kind, _text) in enumerate({tests!r}):
    try:
        if _kind == "value":
            _value = repr(eval(compile(_text, "test_%d" % _index, "eval"), _namespace))
            if len(_value) > {max_repr}:
                _report("test", _index, "error", "result repr longer than {max_repr} characters")
            else:
                _report("test", _index, "value", _value)
        else:
            exec(compile(_text, "test_%d" % _index, "exec"), _namespace)
            _report("test", _index, "pass", "")
    except BaseException as _exc:
        _report("test", _index, "error", ("%s: %s" % (type(_exc).__name__, _exc))[:300])
_sys.stdout.flush()
_os._exit(0)
"""


def harness_program(code: str, tests: Sequence[_Test], marker: str) -> str:
    """Return the sandbox program that runs ``code`` and then each test, reporting per test."""
    specs = [("value", t.expression) if t.expression is not None else ("statement", t.statement)
             for t in tests]
    return _HARNESS.format(marker=marker, solution=code, tests=specs, max_repr=_MAX_RESULT_REPR)


def _read_reports(stdout: bytes, marker: str) -> list[tuple]:
    """Return the harness's report tuples, in order (lines without the marker are ignored)."""
    reports = []
    for line in stdout.decode(errors="replace").splitlines():
        if line.startswith(marker):
            try:
                reports.append(ast.literal_eval(line[len(marker):]))
            except (ValueError, SyntaxError):
                continue
    return reports


def _judge_value(test: _Test, index: int, value_repr: str) -> TestOutcome:
    """Return the verdict for a value test from the repr the sandbox sent back."""
    try:
        value = ast.literal_eval(value_repr)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return TestOutcome(index, False, "wrong_answer",
                           f"test {index}: returned non-literal value {value_repr[:80]}")
    try:
        equal = bool(value == test.expected)
    except Exception:  # noqa: BLE001 - comparing two literals should not raise, but never crash
        equal = False
    if equal:
        return TestOutcome(index, True, "pass", "")
    return TestOutcome(index, False, "wrong_answer",
                       f"test {index}: got {value_repr[:80]}, expected {test.expected!r:.80}")


def _memory_kind(detail: str) -> str:
    """Return "memory" for a MemoryError detail, else "error"."""
    return "memory" if detail.startswith("MemoryError") else "error"


def run_tests(code: str, tests: Sequence[str], limits: SandboxLimits = DEFAULT_LIMITS) -> CodeResult:
    """Return how ``code`` fares against ``tests`` (assert statements) in one sandboxed run."""
    parsed = [parse_test(test) for test in tests]
    if not parsed:
        raise ValueError("run_tests needs at least one test")
    if not code.strip():
        outcomes = [TestOutcome(i, False, "no_code", "no code in the completion") for i in range(len(parsed))]
        return CodeResult(0, len(parsed), outcomes, "no code in the completion", None, ["no_code"])
    marker = "@@polo-" + secrets.token_hex(8) + "@@"
    sandbox = run_python(harness_program(code, parsed, marker), limits)
    reports = _read_reports(sandbox.stdout, marker)
    solution = next((r for r in reports if r[0] == "solution"), None)
    outcomes: dict[int, TestOutcome] = {}
    if solution is not None and solution[1] != "ok":
        kind = "syntax_error" if solution[1] in ("SyntaxError", "IndentationError", "TabError") else (
            "memory" if solution[1] == "MemoryError" else "solution_error")
        reason = f"solution raised {solution[1]}: {solution[2]}"
        outcomes = {i: TestOutcome(i, False, kind, reason) for i in range(len(parsed))}
    for report in reports:
        if report[0] != "test" or not 0 <= report[1] < len(parsed):
            continue
        index, verdict, detail = report[1], report[2], report[3]
        if verdict == "value" and parsed[index].expression is not None:
            outcomes[index] = _judge_value(parsed[index], index, detail)
        elif verdict == "pass" and parsed[index].statement is not None:
            outcomes[index] = TestOutcome(index, True, "pass", "")
        elif verdict == "error":
            kind = "wrong_answer" if detail.startswith("AssertionError") else _memory_kind(detail)
            outcomes[index] = TestOutcome(index, False, kind, f"test {index}: {detail}")
    # Tests the program never reported on: cut short by the sandbox (timeout, signal, output).
    if sandbox.status == "ok":
        missing_kind = "not_run"
        missing_reason = "the program exited before reporting this test"
    else:
        missing_kind, missing_reason = sandbox.status, sandbox.reason
    for index in range(len(parsed)):
        if index not in outcomes:
            outcomes[index] = TestOutcome(index, False, missing_kind, f"test {index}: {missing_reason}")
    ordered = [outcomes[i] for i in range(len(parsed))]
    passed = sum(outcome.passed for outcome in ordered)
    failures = [outcome for outcome in ordered if not outcome.passed]
    reason = "all tests passed" if not failures else failures[0].reason
    return CodeResult(passed, len(parsed), ordered, reason, sandbox,
                      [outcome.kind for outcome in failures])


class CodeReward:
    """The ``code`` reward: ``reward(completion, row)`` is the fraction of ``row["tests"]`` passed.

    Results are cached by (code, tests), so the task's correctness check on the same completion
    does not run it twice. ``failure_counts`` counts failure kinds (one per failed test) since
    the last ``pop_failure_counts()``; ``last_result`` is the latest ``CodeResult``.
    """

    __name__ = "code"

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.failure_counts: collections.Counter[str] = collections.Counter()
        self.last_result: CodeResult | None = None

    def result(self, completion: str, row: dict) -> CodeResult:
        """Return the full CodeResult for one completion (cached)."""
        tests = row.get("tests")
        if not isinstance(tests, (list, tuple)) or not tests:
            raise ValueError(
                f"the code reward needs row['tests'], a non-empty list of assert statements; "
                f"row has fields {sorted(row)}"
            )
        code = extract_code(completion)
        key = (code, tuple(tests), self.limits)
        cached = _CACHE.get(key)
        if cached is None:
            cached = run_tests(code, tests, self.limits)
            _CACHE[key] = cached
            if len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
            self.failure_counts.update(cached.failure_kinds)
            if cached.failure_kinds:
                logger.debug("code reward %d/%d: %s", cached.passed, cached.total, cached.reason)
        else:
            _CACHE.move_to_end(key)
        self.last_result = cached
        return cached

    def __call__(self, completion: str, row: dict) -> float:
        return self.result(completion, row).fraction

    def pop_failure_counts(self) -> dict[str, int]:
        """Return the failure counts since the last call and reset them."""
        counts = dict(self.failure_counts)
        self.failure_counts.clear()
        return counts


_CACHE: collections.OrderedDict[tuple, CodeResult] = collections.OrderedDict()

code_reward = CodeReward()


def all_tests_pass(completion: str, row: dict) -> float:
    """Return 1.0 when the completion's code passes every test of the row, else 0.0."""
    return 1.0 if code_reward.result(completion, row).all_passed else 0.0


__all__ = [
    "CodeResult",
    "CodeReward",
    "DEFAULT_LIMITS",
    "TestOutcome",
    "all_tests_pass",
    "code_reward",
    "extract_code",
    "parse_test",
    "run_tests",
]
