"""Tests for polo.rewards: answer extraction, checkers, format rewards, RewardSet."""

from __future__ import annotations

import functools
import math
import sys
import textwrap
import threading
import time

import pytest
import torch

from polo.data import Task
from polo.data.code import CODE_PROBLEMS_PATH, read_code_problems
from polo.rewards import (
    BUILTIN_REWARDS,
    RewardFunctionError,
    RewardSet,
    exact_number,
    exact_string,
    extract_last_number,
    extract_tagged_answer,
    math_verify_answer,
    r1_format,
    resolve_reward,
    tag_count,
)
from polo.rewards.code import CodeReward, _read_reports, _test_outcomes
from polo.rewards.judge import parse_test, read_value
from polo.sandbox.runner import SandboxLimits

ROW_85 = {"question": "What is 47 + 38?", "answer": "85"}


def make_task(correctness=None) -> Task:
    """Return a small task whose correctness defaults to exact_number."""
    return Task(
        name="toy",
        train_rows=[ROW_85],
        eval_rows=[ROW_85],
        correctness=correctness or functools.partial(exact_number, answer_in_tags=False),
    )


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>12</answer>", "12"),
        ("<answer>1</answer> then <answer> 2 </answer>", " 2 "),
        ("<answer>a<answer>b</answer>", "b"),
        ("<answer>\nmulti\nline\n</answer>", "\nmulti\nline\n"),
        ("no tags", None),
        ("<answer>open only", None),
    ],
)
def test_extract_tagged_answer(text, expected):
    assert extract_tagged_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 apples and 5 pears", "5"),
        ("it is -12.", "-12"),
        ("costs $1,250.50 total", "1250.50"),
        ("10-5", "5"),
        ("values 1,2,3", "3"),
        ("about 3.75", "3.75"),
        ("total 12345", "12345"),
        ("no numbers", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


# ---------------------------------------------------------------- exact_number


@pytest.mark.parametrize(
    ("completion", "answer_in_tags", "expected"),
    [
        ("47 + 38 = 85", False, 1.0),
        ("47 + 38 = 86", False, 0.0),
        ("The answer is 85.0", False, 1.0),
        ("I get 85 then correct to 84", False, 0.0),  # last number counts
        ("<answer>85</answer> and later 3", False, 1.0),  # an answer block wins over later text
        ("<answer>84</answer> but really 85", False, 0.0),
        ("47 + 38 = 85", True, 0.0),  # tags required and absent
        ("<think>47+38</think><answer>85</answer>", True, 1.0),
        ("<answer>The sum is 85</answer>", True, 1.0),
        ("<answer>eighty-five</answer>", True, 0.0),
        ("", False, 0.0),
    ],
)
def test_exact_number(completion, answer_in_tags, expected):
    assert exact_number(completion, ROW_85, answer_in_tags=answer_in_tags) == expected


def test_exact_number_negative_and_commas():
    assert exact_number("so -7", {"answer": "-7"}) == 1.0
    assert exact_number("so 7", {"answer": "-7"}) == 0.0
    assert exact_number("<answer>-7</answer>", {"answer": "-7"}, answer_in_tags=True) == 1.0
    assert exact_number("pays 1,000 dollars", {"answer": "1000"}) == 1.0
    assert exact_number("pays 1000 dollars", {"answer": "1,000"}) == 1.0


def test_exact_number_rejects_non_numeric_reference():
    with pytest.raises(ValueError, match=r"'Paris'.*math_verify"):
        exact_number("Paris", {"answer": "Paris"})


# ---------------------------------------------------------------- math_verify / exact_string


@pytest.mark.parametrize(
    ("completion", "answer_in_tags", "expected"),
    [
        ("So the answer is 85.", False, 1.0),
        ("So the answer is $\\boxed{85}$", False, 1.0),
        ("So the answer is 84.", False, 0.0),
        ("gibberish with no maths", False, 0.0),
        ("<answer>85</answer>", True, 1.0),
        ("So the answer is 85.", True, 0.0),
        ("<answer>\\frac{170}{2}</answer>", True, 1.0),
    ],
)
def test_math_verify_answer(completion, answer_in_tags, expected):
    assert math_verify_answer(completion, ROW_85, answer_in_tags=answer_in_tags) == expected


def test_math_verify_negative_and_fraction_reference():
    assert math_verify_answer("it equals -3", {"answer": "-3"}) == 1.0
    assert math_verify_answer("it equals 3", {"answer": "-3"}) == 0.0
    assert math_verify_answer("<answer>0.5</answer>", {"answer": "\\frac{1}{2}"}) == 1.0


def test_math_verify_works_off_the_main_thread():
    results: list[object] = []

    def score() -> None:
        try:
            results.append(math_verify_answer("<answer>85</answer>", ROW_85, answer_in_tags=True))
        except Exception as exc:  # surfaced to the main thread's assertion below
            results.append(exc)

    worker = threading.Thread(target=score)
    worker.start()
    worker.join()
    assert results == [1.0]


@pytest.mark.parametrize(
    ("completion", "answer_in_tags", "expected"),
    [
        ("  Paris \n", False, 1.0),
        ("PARIS", False, 1.0),
        ("It is Paris", False, 0.0),
        ("It is <answer> paris </answer>", False, 1.0),
        ("Paris", True, 0.0),
        ("<answer>Lyon</answer>", True, 0.0),
    ],
)
def test_exact_string(completion, answer_in_tags, expected):
    assert exact_string(completion, {"answer": "Paris"}, answer_in_tags=answer_in_tags) == expected


# ---------------------------------------------------------------- format rewards


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>47+38=85</think><answer>85</answer>", 1.0),
        ("  <think>\nadd\n</think>\n\n<answer>85</answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("47+38=85</think><answer>85</answer>", 0.0),  # prompt-opened <think> is not accepted
        ("Sure! <think>x</think><answer>85</answer>", 0.0),
        ("<think>x</think> so <answer>85</answer>", 0.0),
        ("<think>x</think><answer>85</answer> done", 0.0),
        ("<answer>85</answer><think>x</think>", 0.0),
        ("<think>x</think><answer>8</answer><answer>5</answer>", 0.0),
        ("<think>a<think>b</think><answer>85</answer>", 0.0),
        ("<think>x</think>", 0.0),
    ],
)
def test_r1_format_is_strict(completion, expected):
    assert r1_format(completion, ROW_85) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>x</think><answer>85</answer>", 1.0),
        ("<answer>85</answer> stuff <think>x</think>", 1.0),  # order is not checked
        ("<think>x</think>", 0.5),
        ("<think>x</think><answer>85", 0.75),
        ("<think>x</think><think>y</think><answer>85</answer>", 0.5),  # duplicates earn nothing
        ("plain text", 0.0),
    ],
)
def test_tag_count_partial_credit(completion, expected):
    value = tag_count(completion, ROW_85)
    assert isinstance(value, float) and value == expected


# ---------------------------------------------------------------- resolve_reward


def test_builtin_rewards_resolve():
    task = make_task()
    assert set(BUILTIN_REWARDS) == {"code", "code_fraction", "correct", "r1_format", "tag_count"}
    assert resolve_reward("correct", task) == ("correct", task.correctness)
    assert resolve_reward("r1_format", task) == ("r1_format", r1_format)
    assert resolve_reward("tag_count", task) == ("tag_count", tag_count)


def test_callable_reward_is_named_by_its_name():
    def brevity(completion: str, row: dict) -> float:
        return -len(completion) / 100

    assert resolve_reward(brevity, make_task()) == ("brevity", brevity)
    name, _ = resolve_reward(functools.partial(exact_number, answer_in_tags=True), make_task())
    assert name == "exact_number"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write an importable module of user rewards and put it on sys.path."""
    source = textwrap.dedent(
        """
        import math

        NOT_CALLABLE = 3

        def length_bonus(completion, row):
            return len(completion) / 10

        def says_hello(completion, row):
            return float("hello" in completion)

        def explodes(completion, row):
            if "boom" in completion:
                raise KeyError("no such field")
            return 0.0

        def returns_nan(completion, row):
            return math.nan

        def returns_text(completion, row):
            return "1.0"
        """
    )
    (tmp_path / "polo_test_user_rewards.py").write_text(source)
    (tmp_path / "polo_test_broken_rewards.py").write_text("import polo_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "polo_test_user_rewards"
    for name in ("polo_test_user_rewards", "polo_test_broken_rewards"):
        sys.modules.pop(name, None)


def test_reward_from_import_path(user_module):
    name, function = resolve_reward(f"{user_module}:length_bonus", make_task())
    assert name == "length_bonus"
    assert function("abcde", ROW_85) == 0.5


def test_import_path_missing_module_names_it():
    expected = r"'polo_no_such_module:fn'.*'polo_no_such_module'"
    with pytest.raises(ModuleNotFoundError, match=expected):
        resolve_reward("polo_no_such_module:fn", make_task())


def test_import_path_keeps_errors_from_inside_user_module(user_module):
    with pytest.raises(ModuleNotFoundError, match="polo_no_such_dependency") as info:
        resolve_reward("polo_test_broken_rewards:fn", make_task())
    assert info.value.name == "polo_no_such_dependency"


def test_import_path_missing_attribute_names_it(user_module):
    with pytest.raises(AttributeError, match=rf"'{user_module}:nope'.*no attribute 'nope'"):
        resolve_reward(f"{user_module}:nope", make_task())


def test_import_path_not_callable_is_rejected(user_module):
    with pytest.raises(TypeError, match=rf"'{user_module}:NOT_CALLABLE' is a int, not a callable"):
        resolve_reward(f"{user_module}:NOT_CALLABLE", make_task())


def test_unknown_plain_name_lists_builtins_and_import_form():
    with pytest.raises(ValueError) as info:
        resolve_reward("accuracy", make_task())
    message = str(info.value)
    assert "'accuracy'" in message
    assert "registered rewards: correct, code, code_fraction, r1_format, tag_count" in message
    assert "module:function" in message


# ---------------------------------------------------------------- RewardSet


def test_reward_set_combines_weights(user_module):
    task = make_task()
    rewards = RewardSet({"correct": 2.0, "tag_count": 0.5, f"{user_module}:says_hello": -1.0}, task)
    assert rewards.names == ["correct", "tag_count", "says_hello"]
    completions = [
        "<think>hello</think><answer>85</answer>",
        "<think>x</think><answer>84</answer>",
        "85",
    ]
    total, columns = rewards.score(completions, [ROW_85] * 3)
    assert torch.equal(columns["correct"], torch.tensor([1.0, 0.0, 1.0]))
    assert torch.equal(columns["tag_count"], torch.tensor([1.0, 1.0, 0.0]))
    assert torch.equal(columns["says_hello"], torch.tensor([1.0, 0.0, 0.0]))
    assert total.dtype == torch.float32 and total.shape == (3,)
    assert torch.allclose(total, torch.tensor([2.0 + 0.5 - 1.0, 0.5, 2.0]))


def test_reward_set_evaluates_zero_weight_rewards_for_logging():
    rewards = RewardSet({"correct": 1.0, "r1_format": 0.0}, make_task())
    total, columns = rewards.score(["<think>a</think><answer>1</answer>"], [ROW_85])
    assert columns["r1_format"].tolist() == [1.0]
    assert total.tolist() == [0.0]


def test_reward_set_correctness_uses_task_correctness():
    calls = []

    def judge(completion: str, row: dict) -> float:
        calls.append(completion)
        return float(completion == "yes")

    rewards = RewardSet({"r1_format": 1.0}, make_task(judge))
    accuracy = rewards.correctness(["yes", "no", "yes"], [ROW_85] * 3)
    assert accuracy.tolist() == [1.0, 0.0, 1.0] and accuracy.dtype == torch.float32
    assert calls == ["yes", "no", "yes"]


def test_raising_reward_names_function_and_sample(user_module):
    rewards = RewardSet({f"{user_module}:explodes": 1.0}, make_task())
    with pytest.raises(RewardFunctionError) as info:
        rewards.score(["fine", "fine", "boom goes the reward"], [ROW_85] * 3)
    message = str(info.value)
    assert "'explodes'" in message and "sample 2" in message and "boom goes" in message
    assert isinstance(info.value.__cause__, KeyError)
    assert info.value.sample_index == 2 and info.value.reward_name == "explodes"


@pytest.mark.parametrize(
    ("function", "fragment"),
    [("returns_nan", "non-finite value nan"), ("returns_text", "returned str '1.0'")],
)
def test_bad_reward_values_are_errors(user_module, function, fragment):
    rewards = RewardSet({f"{user_module}:{function}": 1.0}, make_task())
    with pytest.raises(RewardFunctionError, match=rf"'{function}' failed on sample 0.*{fragment}"):
        rewards.score(["x"], [ROW_85])


def test_long_completion_is_snipped_in_errors():
    def fails(completion: str, row: dict) -> float:
        raise RuntimeError("bad")

    rewards = RewardSet({fails: 1.0}, make_task())
    with pytest.raises(RewardFunctionError) as info:
        rewards.score(["y" * 5000], [ROW_85])
    assert len(str(info.value)) < 300


def test_reward_set_accepts_bool_values():
    rewards = RewardSet({(lambda completion, row: True): 1.0}, make_task())
    total, _ = rewards.score(["a", "b"], [ROW_85, ROW_85])
    assert total.tolist() == [1.0, 1.0]


def test_reward_set_rejects_mismatched_batch():
    rewards = RewardSet({"correct": 1.0}, make_task())
    with pytest.raises(ValueError, match="2 completions but 1 rows"):
        rewards.score(["a", "b"], [ROW_85])


@pytest.mark.parametrize("weight", [math.nan, math.inf, "1.0", None])
def test_reward_set_rejects_bad_weights(weight):
    with pytest.raises(ValueError, match=r"'correct' has weight"):
        RewardSet({"correct": weight}, make_task())


def test_reward_set_rejects_empty_and_duplicate_names():
    with pytest.raises(ValueError, match="at least one reward"):
        RewardSet({}, make_task())

    def r1_format(completion: str, row: dict) -> float:  # same name as the builtin
        return 0.0

    with pytest.raises(ValueError, match="share the name 'r1_format'"):
        RewardSet({"r1_format": 1.0, r1_format: 1.0}, make_task())


def test_empty_batch_scores_to_empty_tensors():
    total, columns = RewardSet({"correct": 1.0}, make_task()).score([], [])
    assert total.shape == (0,) and columns["correct"].shape == (0,)


# ---------------------------------------------------------------- attacks on the code reward
# Model-written programs that try to earn reward without solving, or to crash the trainer. Each is
# scored through RewardSet, as the trainer does, with on_error="raise": nothing may raise, and
# the code reward must be 0 (the fraction too, where a constant could not pass a test).

ATTACK_LIMITS = SandboxLimits(timeout_s=3.0)
# No constant passes any of these, and each statement test hides what its call should return.
ADD_ROW = {
    "tests": [
        "assert add(1, 2) == 3",
        "assert abs(add(0.5, 0.25) - 0.75) < 1e-9",
        "assert not add(2, 2) != 4 and add(-1, -1) < -1",
        "assert isinstance(add(1, 1), int) and add(1, 1) == 2",
    ]
}
MARKER_FROM_FILE = "import re\nMARKER = re.search(r'@@polo-[0-9a-f]+@@', open('/run/polo/main.py').read()).group(0)\n"


def code_rewards() -> RewardSet:
    return RewardSet({"code": 1.0, "code_fraction": 0.0}, make_task(), on_error="raise")


def scored(completion: object, row: dict) -> tuple[float, float]:
    """Return (code, code_fraction) for one completion, as the trainer scores it."""
    _, columns = code_rewards().score([completion], [row])
    return columns["code"].item(), columns["code_fraction"].item()


ANSWER_KEY_THIEF = f"""
import json, os
def find():
    for path in [{str(CODE_PROBLEMS_PATH)!r}] + [os.path.join(r, n) for r, _, ns in os.walk('/') for n in ns]:
        if path.endswith('code_problems.jsonl') and os.path.exists(path):
            return [json.loads(line) for line in open(path)]
    raise LookupError('no answer key in sight')
for problem in find():
    exec(problem['answer'])
"""
FORGER = MARKER_FROM_FILE + (
    "import json, os\n"
    "lines = b''\n"
    "for i in range(8):\n"  # claim every test before the harness can, in every shape
    "    for value in ('True', '3', '0.75', '4'):\n"
    "        for count in (1, 2):\n"
    "            lines += (MARKER + json.dumps({'test': i, 'leaves': [['value', value]] * count}) + '\\n').encode()\n"
    "    lines += (MARKER + repr(('test', i, 'pass', '')) + '\\n').encode()\n"  # the old format
    "for fd in range(1, 64):\n"  # wherever the results go
    "    try:\n"
    "        os.write(fd, lines)\n"
    "    except OSError:\n"
    "        pass\n"
    "def add(a, b):\n"
    "    return 0\n"
)
FRAME_FORGER = (
    "import sys\n"
    "harness = sys._getframe(1).f_globals\n"
    "harness['_repr'] = lambda value: 'True'\n"  # every leaf now "returns" True
    "def add(a, b):\n"
    "    return None\n"
)
RIGGED_FLOAT = (
    "class F(float):\n"
    "    def __eq__(self, other): return True\n"
    "    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__\n"
    "    def __abs__(self): return self\n"
    "    def __sub__(self, other): return self\n"
    "    __add__ = __radd__ = __rsub__ = __sub__\n"
    "    def __bool__(self): return True\n"
    "    __hash__ = float.__hash__\n"
    "def add(a, b):\n"
    "    return F(0.0)\n"
)
PATCHED_BUILTINS = (
    "import builtins\n"
    "builtins.repr = lambda value: '3'\n"
    "builtins.isinstance = lambda *a: True\n"
    "builtins.abs = lambda value: 0\n"
    "class AssertionError(Exception): pass\n"
    "builtins.AssertionError = AssertionError\n"
    "def add(a, b):\n"
    "    return 0\n"
)
FD_CLOSER = "import os\nos.closerange(3, 1024)\ndef add(a, b):\n    return a + b\n"


@pytest.mark.parametrize(
    "program",
    [FORGER, FRAME_FORGER, RIGGED_FLOAT, PATCHED_BUILTINS],
    ids=["forged-report-lines", "harness-frames", "rigged-float", "patched-builtins"],
)
def test_reward_without_solving_earns_nothing(program):
    assert scored(f"```python\n{program}\n```", ADD_ROW) == (0.0, 0.0)


def test_stealing_the_answer_key_earns_nothing():
    problem = read_code_problems()[0]
    code, fraction = scored(f"```python\n{ANSWER_KEY_THIEF}\n```", problem)
    assert (code, fraction) == (0.0, 0.0)
    result = CodeReward(ATTACK_LIMITS).result(ANSWER_KEY_THIEF, problem)
    assert result.failure_kinds[0] == "solution_error" and "no answer key in sight" in result.reason


def test_closing_the_result_channel_earns_nothing():
    assert scored(FD_CLOSER, ADD_ROW) == (0.0, 0.0)


def test_constant_stubs_earn_nothing_by_default():
    problems = read_code_problems()[:6]
    for stub in ("return True", "return 0", "return None", "return []"):
        for problem in problems:
            code, _ = scored(f"def {problem['entry_point']}(*args, **kwargs):\n    {stub}\n", problem)
            assert code == 0.0, (stub, problem["entry_point"])


REPORT_BOMBS = [
    "[" * 100_000 + "]" * 100_000,  # deep JSON
    '{"test": 0, "leaves": 5}',
    '{"test": "0", "leaves": []}',
    '{"test": 0, "leaves": [["value", 5]]}',
    '{"test": 0, "leaves": [["value", "' + "[" * 5000 + '"]]}',  # deep literal
    '{"test": 0, "leaves": [["value", "' + "-" * 9000 + '1"]]}',  # deep unary minus
    '{"test": 0, "leaves": [["value", "' + "9" * 9000 + '"]]}',  # past the int digit limit
    '{"test": 0, "leaves": [["value", "(1,)*10**9"]]}',
    '{"test": 0, "leaves": [["nope"]]}',
    '{"test": 99, "leaves": []}',
    '{"test": true, "leaves": []}',
    '{"solution": ["x"], "detail": {}}',
    "[1, 2]",
    '"text"',
    "null",
    '{"test": 0, "setup_error": [1]}',
    "\udcff\x00 not json",
]


def test_malformed_reports_fail_their_test_and_never_raise():
    parsed = [parse_test(test) for test in ADD_ROW["tests"]]
    for bomb in REPORT_BOMBS:
        reports = _read_reports(("@@m@@" + bomb + "\n").encode(errors="surrogateescape"), "@@m@@")
        outcomes = _test_outcomes(reports, parsed)
        assert not any(outcome.passed for outcome in outcomes.values()), bomb[:60]
    for text in ("[" * 5000, "-" * 9000 + "1", "9" * 9000, "(" * 300 + ")" * 300, None, 5, "x" * 20_000):
        with pytest.raises(Exception) as info:
            read_value(text)
        assert type(info.value).__name__ == "UnreadableValue"


PARENT_BOMBS = [
    # (program, tests): values the program picks, meeting arithmetic the tests do in the parent.
    (
        MARKER_FROM_FILE
        + f"import os, json\nfor bomb in {REPORT_BOMBS[:12]!r}:\n    os.write(1, (MARKER + bomb + '\\n').encode())\n"
        "def add(a, b):\n    return 0\n",
        ADD_ROW["tests"],
    ),
    (
        "def add(a, b):\n    return 10 ** 3000\n",
        ["assert add(1, 2) ** add(1, 2) == 27", "assert 2 ** add(1, 2) == 8", "assert 1 << add(1, 2) == 8"],
    ),
    (
        "def add(a, b):\n    return 'x' * 9000\n",
        ["assert add(1, 2) * 10 ** 9 == ''", "assert [0] * len(add(1, 2)) * 10 ** 6 == []"],
    ),
    (
        "def add(a, b):\n    x = []\n    for _ in range(100000):\n        x = [x]\n    return x\n",
        ["assert add(1, 2) == 3"],
    ),
    (
        "import builtins\ndef boom(*a):\n    raise RecursionError\nbuiltins.repr = boom\n"
        "def add(a, b):\n    return 4\n",
        ["assert add(1, 2) == 3"],
    ),
    (
        "class R:\n    def __repr__(self):\n        return 5\ndef add(a, b):\n    return R()\n",
        ["assert add(1, 2) == 3"],
    ),
    (
        "class S(str):\n    pass\nclass R:\n    def __repr__(self):\n        return S('3')\n"
        "def add(a, b):\n    return R()\n",
        ["assert add(1, 2) == 3"],
    ),
]


@pytest.mark.parametrize(
    "program, tests",
    PARENT_BOMBS,
    ids=["forged-bombs", "huge-int", "huge-str", "deep-list", "repr-raises", "repr-not-str", "repr-str-subclass"],
)
def test_programs_cannot_crash_or_stall_the_parent(program, tests):
    started = time.monotonic()
    code, fraction = scored(program, {"tests": tests})
    assert (code, fraction) == (0.0, 0.0)
    assert time.monotonic() - started < ATTACK_LIMITS.timeout_s + 5


@pytest.mark.parametrize(
    "completion", [None, b"def add(a, b): return a + b", "\ud800\x00def add(a, b):\n", "x" * 10**6]
)
def test_odd_completions_score_zero(completion):
    assert scored(completion, ADD_ROW) == (0.0, 0.0)


def test_accuracy_check_never_stops_training(user_module):
    def checker(completion, row):
        if "boom" in completion:
            raise RecursionError("maximum recursion depth exceeded")
        return float("nan") if "nan" in completion else 1.0

    for on_error in ("raise", "zero"):
        rewards = RewardSet({"r1_format": 1.0}, make_task(checker), on_error=on_error)
        accuracy = rewards.correctness(["fine", "boom", "nan"], [ROW_85] * 3)
        assert accuracy.tolist() == [1.0, 0.0, 0.0]
        assert rewards.failure_counts() == {"correct": {"RecursionError": 1, "non_finite": 1}}
        assert rewards.failure_counts() == {}  # counted once


def test_reward_module_in_the_current_directory_is_importable(tmp_path, monkeypatch):
    (tmp_path / "polo_cwd_reward.py").write_text("def shout(completion, row):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        name, function = resolve_reward("polo_cwd_reward:shout", make_task())
        assert (name, function("x", ROW_85)) == ("shout", 1.0)
    finally:
        sys.modules.pop("polo_cwd_reward", None)
