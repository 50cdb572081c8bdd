"""The ``code`` reward: 1.0 when the completion's Python code passes every test of its row.

Which code is run (``extract_code``): the last fenced block tagged ``python``/``py``/``python3``;
else the last fenced block of any language; else the whole completion. A fence cut off by the
token limit (no closing ```) runs to the end of the text.

A row's ``"tests"`` are Python asserts, each optionally after setup statements. Every test is
judged *here, in the parent*: its assert is split into the calls only the program can make
(*leaves*, e.g. ``f(2)``, evaluated in the sandbox and sent back as ``repr``) and the rest
(comparisons, arithmetic, ``and``/``or``/``not``, literals, a few pure builtins and ``math``
functions), which never enters the sandbox. So the program is never told what a leaf should be,
and nothing it prints can pass a test it did not compute: a report line is at most a claim about
leaf values. Values are read back with a bounded literal parser (size, node and depth limits),
so an object with rigged comparison dunders becomes a plain literal before anything compares it,
and every malformed report fails its test instead of raising.

All-or-nothing by default (``code``): constant stubs (``return True``, ``return 0``, ...) earned
a mean 0.30 over the built-in problems under fractional credit without solving any; the
fraction of tests passed is the opt-in ``code_fraction`` reward (docs/sandbox.md).

The reward never raises because of a completion: every failure, an internal one included, is a
scored 0 with a kind (``CodeResult.failure_kinds``), counted in ``CodeReward.failure_counts`` and
logged by the trainer as ``reward/code/failures/<kind>``.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from polo.core.registry import register_reward
from polo.rewards.judge import MAX_VALUE_CHARS, LeafError, ParsedTest, UnreadableValue, judge, parse_test, read_value
from polo.sandbox.runner import SandboxError, SandboxLimits, SandboxResult, run_python, shipped_text

logger = logging.getLogger(__name__)

# Short programs: generous for the built-in task, small enough that a batch of infinite loops
# costs seconds, not minutes.
DEFAULT_LIMITS = SandboxLimits(timeout_s=3.0, memory_bytes=512 * 2**20, max_output_bytes=64 * 2**10)
_MAX_REPORT_CHARS = 1 << 20
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


@functools.cache
def harness_source() -> str:
    """Return the text of `polo.rewards.harness`, the program every completion runs inside, as the package ships it."""
    # No completion can be scored without it: stop the run as a sandbox that cannot run does.
    return shipped_text("polo.rewards", "harness.py", "the code reward", "harness")


def harness_program(code: str, tests: Sequence[ParsedTest], marker: str) -> str:
    """Return the sandbox program that runs ``code`` and then each test's setup and leaves.

    It is the harness module's text with one call appended, its arguments written as literals.
    """
    specs = [(list(t.setup), list(t.leaves)) for t in tests]
    return f"{harness_source()}\n\nmain({marker!r}, {code!r}, {specs!r}, {MAX_VALUE_CHARS!r})\n"


def _read_reports(stdout: bytes, marker: str) -> list[dict]:
    """Return the harness's reports, in order: JSON objects behind the marker (anything else is skipped)."""
    reports = []
    for line in stdout.decode(errors="replace").splitlines():
        if not line.startswith(marker) or len(line) > _MAX_REPORT_CHARS:
            continue
        try:
            report = json.loads(line[len(marker) :])
        except (ValueError, RecursionError, MemoryError):
            continue
        if isinstance(report, dict):
            reports.append(report)
    return reports


def _solution_outcomes(reports: list[dict], count: int) -> dict[int, TestOutcome]:
    """Return a failure for every test when the solution itself raised, else nothing."""
    solution = next((r for r in reports if "solution" in r), None)
    if solution is None or solution.get("solution") == "ok":
        return {}
    error, detail = str(solution.get("solution"))[:80], str(solution.get("detail"))[:300]
    kind = (
        "syntax_error"
        if error in ("SyntaxError", "IndentationError", "TabError")
        else ("memory" if error == "MemoryError" else "solution_error")
    )
    return {i: TestOutcome(i, False, kind, f"solution raised {detail or error}") for i in range(count)}


def _leaf_values(report: dict, test: ParsedTest) -> list[object] | None:
    """Return the values a test report gives for the test's leaves (a LeafError per failed leaf); None if malformed."""
    leaves = report.get("leaves")
    if not isinstance(leaves, list) or len(leaves) != len(test.leaves):
        return None
    values: list[object] = []
    for entry in leaves:
        if not (
            isinstance(entry, list) and len(entry) == 2 and entry[0] in ("value", "error") and isinstance(entry[1], str)
        ):
            return None
        if entry[0] == "error":
            values.append(LeafError(entry[1][:300]))
            continue
        try:
            values.append(read_value(entry[1]))
        except LeafError as exc:
            values.append(exc)
    return values


def _test_outcome(report: dict, test: ParsedTest, index: int) -> TestOutcome:
    """Return one test's verdict from its report, judged here."""
    if "setup_error" in report:
        detail = str(report["setup_error"])[:300]
        return TestOutcome(index, False, _error_kind(detail), f"test {index}: setup raised {detail}")
    values = _leaf_values(report, test)
    if values is None:
        return TestOutcome(index, False, "malformed_report", f"test {index}: malformed result")
    passed, reason = judge(test, values)
    if passed:
        return TestOutcome(index, True, "pass", "")
    errors = [v for v in values if isinstance(v, LeafError) and not isinstance(v, UnreadableValue)]
    kind = _error_kind(str(errors[0])) if errors else "wrong_answer"
    return TestOutcome(index, False, kind, f"test {index}: {reason}")


def _error_kind(detail: str) -> str:
    """Return the failure kind for an error a test raised in the sandbox."""
    if detail.startswith("MemoryError"):
        return "memory"
    if detail.startswith("AssertionError"):
        return "wrong_answer"
    return "error"


def _test_outcomes(reports: list[dict], parsed: list[ParsedTest]) -> dict[int, TestOutcome]:
    """Return the verdict of every test the harness reported on (the first report of each counts)."""
    outcomes = _solution_outcomes(reports, len(parsed))
    for report in reports:
        index = report.get("test")
        if type(index) is not int or not 0 <= index < len(parsed) or index in outcomes:
            continue
        outcomes[index] = _test_outcome(report, parsed[index], index)
    return outcomes


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
    outcomes = _test_outcomes(_read_reports(sandbox.stdout, marker), parsed)
    # Tests the program never reported on: cut short by the sandbox (timeout, signal, output).
    if sandbox.status == "ok":
        missing_kind, missing_reason = "not_run", "the program exited before reporting this test"
    else:
        missing_kind, missing_reason = sandbox.status, sandbox.reason
    ordered = [
        outcomes.get(i) or TestOutcome(i, False, missing_kind, f"test {i}: {missing_reason}")
        for i in range(len(parsed))
    ]
    return _code_result(ordered, sandbox)


def _code_result(ordered: list[TestOutcome], sandbox: SandboxResult | None) -> CodeResult:
    """Return the CodeResult summarising per-test outcomes."""
    passed = sum(outcome.passed for outcome in ordered)
    failures = [outcome for outcome in ordered if not outcome.passed]
    reason = "all tests passed" if not failures else failures[0].reason
    return CodeResult(passed, len(ordered), ordered, reason, sandbox, [outcome.kind for outcome in failures])


class CodeReward:
    """The ``code`` reward: 1.0 when the completion passes every test of ``row["tests"]``, else 0.0
    (``partial_credit=True``: the fraction passed, the ``code_fraction`` reward).

    Results are cached by (code, tests), so the task's correctness check on the same completion
    does not run it twice. ``failure_counts`` counts failure kinds (one per failed test) since
    the last ``pop_failure_counts()``; ``last_result`` is the latest ``CodeResult``. Only a row
    without usable tests raises (a data error, the same for every completion); nothing a
    completion contains does.
    """

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS, partial_credit: bool = False) -> None:
        self.limits = limits
        self.partial_credit = partial_credit
        self.__name__ = "code_fraction" if partial_credit else "code"
        self.failure_counts: collections.Counter[str] = collections.Counter()
        self.last_result: CodeResult | None = None

    def result(self, completion: str, row: dict) -> CodeResult:
        """Return the full CodeResult for one completion (cached)."""
        tests = row.get("tests") if isinstance(row, dict) else None
        if not isinstance(tests, (list, tuple)) or not tests:
            fields = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"the code reward needs row['tests'], a non-empty list of assert statements; row has fields {fields}"
            )
        for test in tests:
            parse_test(test)  # a malformed test is the dataset's error: raise it, naming the test
        code = extract_code(completion) if isinstance(completion, str) else None
        key = (code, tuple(tests), self.limits)
        cached = _CACHE.get(key)
        if cached is None:
            cached = _scored(code, list(tests), self.limits)
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
        result = self.result(completion, row)
        return result.fraction if self.partial_credit else float(result.all_passed)

    def pop_failure_counts(self) -> dict[str, int]:
        """Return the failure counts since the last call and reset them."""
        counts = dict(self.failure_counts)
        self.failure_counts.clear()
        return counts


def _scored(code: str | None, tests: list[str], limits: SandboxLimits) -> CodeResult:
    """Return run_tests' result, or a scored failure of kind ``internal_error`` when scoring itself broke.

    Only SandboxError passes through: the sandbox cannot run on this machine at all, which no
    completion caused and which would otherwise score every completion 0 without a word.
    """
    if code is None:
        outcomes = [TestOutcome(i, False, "no_code", "the completion is not text") for i in range(len(tests))]
        return _code_result(outcomes, None)
    try:
        return run_tests(code, tests, limits)
    except SandboxError:
        raise
    except Exception as exc:  # e.g. MemoryError on a huge completion: that completion fails, training goes on
        logger.warning("code reward: scoring a completion failed (%s: %.200s); scored 0", type(exc).__name__, exc)
        reason = f"scoring failed: {type(exc).__name__}"
        return _code_result([TestOutcome(i, False, "internal_error", reason) for i in range(len(tests))], None)


_CACHE: collections.OrderedDict[tuple, CodeResult] = collections.OrderedDict()

# One shared instance each, so the result cache also serves the code task's correctness check.
code_reward = register_reward("code", help="1 when the program passes every test of the row, else 0")(CodeReward())
code_fraction_reward = register_reward("code_fraction", help="the fraction of the row's tests the program passes")(
    CodeReward(partial_credit=True)
)


def all_tests_pass(completion: str, row: dict) -> float:
    """Return 1.0 when the completion's code passes every test of the row, else 0.0."""
    return 1.0 if code_reward.result(completion, row).all_passed else 0.0


__all__ = [
    "DEFAULT_LIMITS",
    "CodeResult",
    "CodeReward",
    "TestOutcome",
    "all_tests_pass",
    "code_fraction_reward",
    "code_reward",
    "extract_code",
    "harness_program",
    "judge",
    "parse_test",
    "read_value",
    "run_tests",
]
