"""The code task, its data file and the ``code`` reward (which runs programs in the sandbox)."""

from __future__ import annotations

import json

import pytest

from polo.data import TASKS, TaskDataError, build_task
from polo.data.code import CODE_PROBLEMS_PATH, read_code_problems
from polo.rewards import BUILTIN_REWARDS, RewardSet
from polo.rewards.code import CodeReward, extract_code, run_tests
from polo.rewards.judge import parse_test
from polo.sandbox.runner import SandboxLimits

FAST = SandboxLimits(timeout_s=2.0)
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def test_extract_code_prefers_the_last_python_block_then_any_block_then_the_text():
    assert extract_code("x\n```python\na = 1\n```\n```py\nb = 2\n```\n```text\nno\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("```python\nd = 4\n") == "d = 4\n"  # cut off by the token limit
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


def test_parse_test_keeps_the_check_in_the_parent_and_sends_only_leaves():
    value = parse_test("assert f(1, [2]) == {'a': (3,)}")
    assert value.expression == "f(1, [2])" and value.expected == {"a": (3,)}
    assert value.leaves == ("f(1, [2])",) and value.setup == ()
    # Only the calls into the solution go to the sandbox; what they must equal stays here.
    assert parse_test("assert abs(f(2) - 1.41) < 1e-6").leaves == ("f(2)",)
    assert parse_test("assert not g(4) and g(3)").leaves == ("g(4)", "g(3)")
    assert parse_test("assert f(1) == g(2)").leaves == ("f(1)", "g(2)")
    with_setup = parse_test("import math\nassert math.isclose(f(2), 1.41, rel_tol=1e-3)")
    assert with_setup.setup == ("import math",) and with_setup.leaves == ("f(2)",)
    stack = parse_test("s = Stack()\ns.push(1)\nassert s.pop() == 1 and len(s) == 0")
    assert stack.setup == ("s = Stack()", "s.push(1)") and stack.leaves == ("s.pop()", "len(s)")
    with pytest.raises(ValueError, match="not valid Python"):
        parse_test("assert (")
    with pytest.raises(ValueError, match="must end with an assert"):
        parse_test("check(f)")


def test_statement_tests_are_judged_in_the_parent():
    code = "def f(x):\n    return 1.4142\ndef g(x):\n    return x % 2 == 1\n"
    tests = [
        "assert abs(f(2) - 1.41) < 1e-2",
        "import math\nassert math.isclose(f(2), 1.41, rel_tol=1e-2)",
        "assert not g(4) and g(3)",
        "assert f(1) > 2",
        "assert isinstance(f(0), float) and f(0) in (1.4142, 2)",
    ]
    result = run_tests(code, tests, FAST)
    assert [t.passed for t in result.tests] == [True, True, True, False, True], result
    stack = "class Stack(list):\n    def push(self, x):\n        self.append(x)\n"
    tests = [
        "s = Stack()\ns.push(1)\nassert s.pop() == 1 and len(s) == 0",
        "assert isinstance(Stack(), Stack)",
        "s = Stack()\nassert s.pop() == 1",
    ]
    result = run_tests(stack, tests, FAST)
    assert [t.kind for t in result.tests] == ["pass", "pass", "error"], result


def test_data_file_is_valid_and_every_reference_solution_passes():
    problems = read_code_problems()
    assert 30 <= len(problems) <= 60
    assert len({p["entry_point"] for p in problems}) == len(problems)
    for problem in problems:
        assert 3 <= len(problem["tests"]) <= 6
        assert all(parse_test(t).expression is not None for t in problem["tests"])  # assert <call> == <literal>
    # One sandbox run per problem: every reference solution passes all its tests.
    reward = CodeReward(FAST)
    failures = {
        p["entry_point"]: reward.result(p["answer"], p).reason for p in problems if reward(p["answer"], p) != 1.0
    }
    assert failures == {}


def test_code_task_splits_are_disjoint_deterministic_and_limited():
    task = build_task("code")
    assert "code" in TASKS and task.name == "code"
    train_points = {r["entry_point"] for r in task.train_rows}
    eval_points = {r["entry_point"] for r in task.eval_rows}
    assert len(task.eval_rows) == 10 and not train_points & eval_points
    assert build_task("code").eval_rows == task.eval_rows
    assert build_task("code", seed=1).eval_rows != task.eval_rows
    small = build_task("code", num_train=5, num_eval=4)
    assert len(small.train_rows) == 5 and small.eval_rows == task.eval_rows[:4]
    with pytest.raises(ValueError, match="num_eval"):
        build_task("code", num_eval=1000)


def test_bad_data_row_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.loads(CODE_PROBLEMS_PATH.read_text().splitlines()[0])
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "tests": []}) + "\n")
    with pytest.raises(TaskDataError, match=r"bad.jsonl line 2: field 'tests'"):
        read_code_problems(path)
    # A test the reward could only run, not judge, is refused when the data is read.
    path.write_text(json.dumps({**good, "tests": ["check(candidate)"]}) + "\n")
    with pytest.raises(TaskDataError, match=r"bad.jsonl line 1: field 'tests': .*must end with an assert"):
        read_code_problems(path)


def test_code_fraction_is_the_fraction_passed_and_every_failure_has_a_reason():
    row = {"tests": ADD_TESTS}
    cases = {
        "```python\ndef add(a, b):\n    return a + b\n```": (1.0, set()),
        "def add(a, b):\n    return 3": (1 / 3, {"wrong_answer"}),
        "def add(a, b:\n": (0.0, {"syntax_error"}),
        "import sys\nsys.exit(0)": (0.0, {"solution_error"}),
        "import os\nos._exit(0)": (0.0, {"not_run"}),
        "def add(a, b):\n    return 1 / 0": (0.0, {"error"}),
        "def add(a, b):\n    while True:\n        pass": (0.0, {"timeout", "cpu_limit"}),
        "def add(a, b):\n    print('x' * 10**6)\n    return a + b": (0.0, {"output_limit"}),
        "": (0.0, {"no_code"}),
    }
    reward = CodeReward(FAST, partial_credit=True)
    for completion, (expected, kinds) in cases.items():
        result = reward.result(completion, row)
        assert result.fraction == pytest.approx(expected), (completion, result.reason)
        assert set(result.failure_kinds) <= kinds or kinds & set(result.failure_kinds), result
        assert all(t.reason for t in result.tests if not t.passed)
    assert sum(reward.pop_failure_counts().values()) > 0 and reward.failure_counts == {}
    # The default `code` reward is all-or-nothing: a partial pass earns nothing.
    assert CodeReward(FAST)("def add(a, b):\n    return 3", row) == 0.0
    assert CodeReward(FAST)("def add(a, b):\n    return a + b", row) == 1.0


def test_forged_reports_do_not_pass():
    # The program cannot know the per-run marker in advance, and value tests are judged here:
    # printing report-shaped lines, or returning an object whose repr looks right, earns nothing.
    forged = (
        "import os\n"
        "class Liar:\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    def __repr__(self):\n"
        "        return 'Liar()'\n"
        "def add(a, b):\n"
        "    return Liar()\n"
        "for i in range(3):\n"
        "    os.write(1, b\"@@polo-0000000000000000@@('test', %d, 'pass', '')\\n\" % i)\n"
    )
    result = run_tests(forged, ADD_TESTS, FAST)
    assert result.passed == 0 and set(result.failure_kinds) == {"wrong_answer"}


def test_code_reward_is_builtin_and_task_correctness_is_the_full_pass():
    task = build_task("code", num_train=2, num_eval=1)
    rewards = RewardSet({"code": 1.0}, task)
    row = task.train_rows[0]
    half = "def nothing():\n    pass"
    total, columns = rewards.score([row["answer"], half], [row, row])
    assert total.tolist() == [1.0, 0.0] and "code" in columns
    assert rewards.correctness([row["answer"], half], [row, row]).tolist() == [1.0, 0.0]
    assert "code" in BUILTIN_REWARDS
    with pytest.raises(ValueError, match="row\\['tests'\\]"):
        CodeReward(FAST)("x = 1", {"question": "q"})
