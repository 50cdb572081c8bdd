"""The code reward's harness (polo.rewards.harness) as a module: run in-process on trusted solutions, its
reports read back and judged by polo.rewards.code exactly as a sandboxed run's are; and the program
the sandbox receives being the module's text plus one call.

The adversarial cases (forged reports, patched builtins, harness frames) run in the sandbox, in
tests/rewards/test_rewards.py."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from polo.rewards import code, harness
from polo.rewards.code import CodeReward, _read_reports, _test_outcomes, harness_program
from polo.rewards.judge import MAX_VALUE_CHARS, parse_test
from polo.sandbox import runner
from polo.sandbox.runner import SandboxError

MARKER = "@@polo-0123456789abcdef@@"
ADD = "def add(a, b):\n    return a + b\n"


def reports_of(solution: str, tests: list[str], max_repr: int = MAX_VALUE_CHARS) -> list[dict]:
    """Return the harness's reports for `solution` against `tests`, run in this process."""
    sent: list[dict] = []
    specs = [(list(test.setup), list(test.leaves)) for test in map(parse_test, tests)]
    harness.run(solution, specs, lambda **fields: sent.append(fields), max_repr)
    return sent


def verdicts(solution: str, tests: list[str]) -> list[tuple[bool, str]]:
    """Return (passed, kind) per test: the harness run here, its report lines read and judged by the parent."""
    stdout = "".join(MARKER + json.dumps(report) + "\n" for report in reports_of(solution, tests)).encode()
    parsed = [parse_test(test) for test in tests]
    outcomes = _test_outcomes(_read_reports(stdout, MARKER), parsed)
    return [(outcomes[i].passed, outcomes[i].kind) for i in range(len(tests))]


def test_reports_carry_each_leaf_value_and_the_parent_judges_them():
    tests = ["assert add(2, 3) == 5", "assert abs(add(0.5, 0.25) - 0.75) < 1e-9", "assert add('a', 1) == 'a1'"]
    reports = reports_of(ADD, tests)
    assert reports[0] == {"solution": "ok", "detail": ""}
    assert reports[1] == {"test": 0, "leaves": [["value", "5"]]}
    assert reports[2] == {"test": 1, "leaves": [["value", "0.75"]]}
    assert reports[3]["test"] == 2 and reports[3]["leaves"][0][0] == "error"
    assert reports[3]["leaves"][0][1].startswith("TypeError: can only concatenate str")
    assert verdicts(ADD, tests) == [(True, "pass"), (True, "pass"), (False, "error")]


def test_a_wrong_solution_fails_exactly_the_tests_it_gets_wrong():
    tests = ["assert add(1, 1) == 2", "assert add(2, 3) == 5", "assert add(0, 0) == 0"]
    wrong = "def add(a, b):\n    return a * b if a == b else a - b\n"  # right for (0, 0) only
    assert verdicts(wrong, tests) == [(False, "wrong_answer"), (False, "wrong_answer"), (True, "pass")]


def test_a_solution_that_raises_runs_no_test():
    reports = reports_of("x = 1 / 0\n" + ADD, ["assert add(1, 2) == 3"])
    assert reports == [{"solution": "ZeroDivisionError", "detail": "ZeroDivisionError: division by zero"}]
    assert verdicts("x = 1 / 0\n" + ADD, ["assert add(1, 2) == 3"]) == [(False, "solution_error")]
    assert verdicts("def add(a, b) return a\n", ["assert add(1, 2) == 3"]) == [(False, "syntax_error")]


def test_setup_runs_in_a_copy_of_the_solution_namespace():
    tests = ["y = 2\nassert add(y, 1) == 3", "assert add(y, 1) == 3", "z = 1 / 0\nassert add(1, 1) == 2"]
    reports = reports_of(ADD, tests)
    assert reports[1] == {"test": 0, "leaves": [["value", "3"]]}
    assert reports[2]["leaves"][0] == ["error", "NameError: name 'y' is not defined"]  # test 0's setup did not leak
    assert reports[3] == {"test": 2, "setup_error": "ZeroDivisionError: division by zero"}
    assert verdicts(ADD, tests) == [(True, "pass"), (False, "error"), (False, "error")]


def test_values_too_long_or_unprintable_are_errors_not_values():
    solution = ADD + "class Loud:\n    def __repr__(self):\n        raise RuntimeError('no')\n"
    reports = reports_of(solution, ["assert 'x' * 50 == add('x' * 25, 'x' * 25)", "assert Loud() == 1"], max_repr=40)
    assert reports[1]["leaves"] == [["error", "result repr longer than 40 characters"]]
    assert reports[2]["leaves"] == [["error", "RuntimeError: no"]]


def test_describe_survives_an_exception_whose_text_raises():
    class Broken(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    assert harness.describe(Broken()) == "Broken"
    assert harness.describe(ValueError("v" * 1000)) == ("ValueError: " + "v" * 1000)[:300]


def test_the_solution_is_compiled_on_its_own_terms():
    # The harness's `from __future__ import annotations` must not reach the solution.
    solution = "def f(x: int):\n    return x\n"
    sent: list[dict] = []
    harness.run(solution, [([], ["f.__annotations__['x'] is int"])], lambda **fields: sent.append(fields), 100)
    assert sent[1] == {"test": 0, "leaves": [["value", "True"]]}


def test_the_program_is_the_module_text_and_one_call():
    tests = [parse_test("x = 2\nassert add(x, 1) == 3")]
    program = harness_program(ADD, tests, MARKER)
    module_text = Path(harness.__file__).read_text(encoding="utf-8")
    assert program.startswith(module_text)
    call = ast.parse(program).body[-1].value
    assert isinstance(call, ast.Call) and call.func.id == "main"
    assert [ast.literal_eval(arg) for arg in call.args] == [MARKER, ADD, [(["x = 2"], ["add(x, 1)"])], 10_000]
    assert "3" not in ast.unparse(call.args[2])  # the expected value never enters the program


def test_the_program_reports_on_stdout_and_leaves_the_solution_stderr(tmp_path):
    solution = ADD + "print('chatter')\n"
    program = harness_program(solution, [parse_test("assert add(1, 2) == 3")], MARKER)
    # Outside the sandbox (a trusted solution): main()'s own file descriptors, as the sandbox runs it.
    finished = subprocess.run([sys.executable, "-I", "-S", "-c", program], capture_output=True, text=True, timeout=30)
    assert finished.returncode == 0, finished.stderr
    assert finished.stderr == "chatter\n"
    lines = finished.stdout.splitlines()
    assert all(line.startswith(MARKER) for line in lines)
    assert [json.loads(line[len(MARKER) :]) for line in lines] == [
        {"solution": "ok", "detail": ""},
        {"test": 0, "leaves": [["value", "3"]]},
    ]


def test_a_missing_harness_stops_scoring_with_one_line(monkeypatch, tmp_path):
    # polo.sandbox.runner reads the files that run in the sandbox, the harness among them
    monkeypatch.setattr(runner, "resources", types.SimpleNamespace(files=lambda package: tmp_path))  # no harness.py
    code.harness_source.cache_clear()
    try:
        with pytest.raises(SandboxError, match=r"^the code reward cannot run: its harness polo/rewards/harness.py"):
            CodeReward()("def add(a, b):\n    return a + b\n", {"tests": ["assert add(5, 7) == 12"]})
    finally:
        monkeypatch.undo()
        code.harness_source.cache_clear()
