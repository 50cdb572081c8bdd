"""Tests for polo.data: arithmetic generation, GSM8K and jsonl loading, prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from polo.config import ConfigError, load_config
from polo.data import (
    DEFAULT_INSTRUCTION,
    PLAIN_INSTRUCTION,
    TASKS,
    Task,
    TaskDataError,
    arithmetic_task,
    build_task,
    format_prompt,
    gsm8k_task,
    jsonl_task,
    make_task,
    read_jsonl,
)
from polo.data.arithmetic import count_problems
from polo.data.gsm8k import GSM8K_ENV

GSM8K_DIR = Path(os.environ.get(GSM8K_ENV, "/nonexistent"))  # tests/conftest.py sets it where the data is
needs_gsm8k = pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason=f"no GSM8K data folder (${GSM8K_ENV}: {GSM8K_DIR})")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(chat_template: str | None):
    """Return a word-level fast tokenizer built locally (no downloads), with the given template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "what": 1, "is": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template
    return tokenizer


def write_lines(path: Path, lines: list[str]) -> Path:
    """Write raw text lines to ``path`` and return it."""
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Write rows as jsonl to ``path`` and return it."""
    return write_lines(path, [json.dumps(row) for row in rows])


# ---------------------------------------------------------------- arithmetic


def triples(rows: list[dict]) -> set[tuple[int, str, int]]:
    return {(row["operands"][0], row["operator"], row["operands"][1]) for row in rows}


def test_arithmetic_is_deterministic_in_the_seed():
    first = arithmetic_task(seed=3, num_train=300, num_eval=50)
    again = arithmetic_task(seed=3, num_train=300, num_eval=50)
    other = arithmetic_task(seed=4, num_train=300, num_eval=50)
    assert first.train_rows == again.train_rows
    assert first.eval_rows == again.eval_rows
    assert first.train_rows != other.train_rows


def test_arithmetic_splits_are_disjoint_and_have_requested_sizes():
    task = arithmetic_task(seed=0, operators=("+", "-"), num_train=2000, num_eval=300)
    assert len(task.train_rows) == 2000 and len(task.eval_rows) == 300
    train, held_out = triples(task.train_rows), triples(task.eval_rows)
    assert len(train) == 2000 and len(held_out) == 300  # no duplicates inside a split
    assert not train & held_out


def test_arithmetic_disjoint_when_requesting_the_whole_space():
    space = count_problems(["*"], 1, 1)
    task = arithmetic_task(operators=["*"], min_digits=1, max_digits=1, num_train=space - 10, num_eval=10)
    assert triples(task.train_rows) | triples(task.eval_rows) == {(a, "*", b) for a in range(10) for b in range(10)}
    assert not triples(task.train_rows) & triples(task.eval_rows)


def test_arithmetic_eval_split_does_not_depend_on_num_train():
    small = arithmetic_task(seed=5, min_digits=3, max_digits=3, num_train=10, num_eval=40)
    large = arithmetic_task(seed=5, min_digits=3, max_digits=3, num_train=500, num_eval=40)
    assert small.eval_rows == large.eval_rows


@pytest.mark.parametrize("operators", [("+",), ("-",), ("*",), ("+", "-", "*")])
def test_arithmetic_honours_operators_and_answers(operators):
    task = arithmetic_task(operators=operators, num_train=200, num_eval=20)
    rows = task.train_rows + task.eval_rows
    assert {row["operator"] for row in rows} == set(operators)
    compute = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for row in rows:
        a, b = row["operands"]
        assert row["question"] == f"What is {a} {row['operator']} {b}?"
        assert row["answer"] == str(compute[row["operator"]](a, b))


def test_arithmetic_subtraction_can_be_negative_and_is_scored():
    task = arithmetic_task(operators=["-"], num_train=300, num_eval=0)
    negative = next(row for row in task.train_rows if row["answer"].startswith("-"))
    assert task.correctness(f"The result is {negative['answer']}.", negative) == 1.0
    assert task.correctness(f"The result is {negative['answer'][1:]}.", negative) == 0.0


def test_arithmetic_digit_range_is_respected():
    task = arithmetic_task(min_digits=1, max_digits=3, num_train=500, num_eval=0)
    digit_counts = {len(str(n)) for row in task.train_rows for n in row["operands"]}
    assert digit_counts == {1, 2, 3}


def test_arithmetic_rejects_too_small_space_naming_its_size():
    with pytest.raises(ValueError, match=r"only 100\b") as info:
        arithmetic_task(operators=["+"], min_digits=1, max_digits=1, num_train=95, num_eval=10)
    assert "105" in str(info.value)


def test_arithmetic_rejects_unknown_operator_naming_valid_ones():
    with pytest.raises(ValueError, match=r"'/'.*valid operators: \['\+', '-', '\*'\]"):
        arithmetic_task(operators=["+", "/"])


@pytest.mark.parametrize(
    "options",
    [{"min_digits": 0}, {"min_digits": 3, "max_digits": 2}, {"num_train": -1}, {"operators": []}],
)
def test_arithmetic_rejects_bad_settings(options):
    with pytest.raises(ValueError):
        arithmetic_task(**options)


def test_arithmetic_answer_in_tags_changes_correctness_and_instruction():
    tagged = arithmetic_task(num_train=5, num_eval=1, answer_in_tags=True)
    plain = arithmetic_task(num_train=5, num_eval=1, answer_in_tags=False)
    row = tagged.eval_rows[0]
    untagged_completion = f"It is {row['answer']}"
    assert tagged.correctness(untagged_completion, row) == 0.0
    assert plain.correctness(untagged_completion, row) == 1.0
    assert tagged.correctness(f"<answer>{row['answer']}</answer>", row) == 1.0
    assert tagged.instruction == DEFAULT_INSTRUCTION
    assert plain.instruction == PLAIN_INSTRUCTION


# ---------------------------------------------------------------- prompts


def test_format_prompt_uses_chat_template_when_present():
    tokenizer = tiny_tokenizer(CHAT_TEMPLATE)
    prompt = format_prompt(tokenizer, "What is 1 + 2?", "Q: {question}", system_prompt="Be brief.")
    assert prompt == "<|system|>Be brief.\n<|user|>Q: What is 1 + 2?\n<|assistant|>"
    without_system = format_prompt(tokenizer, "What is 1 + 2?", "Q: {question}")
    assert without_system == "<|user|>Q: What is 1 + 2?\n<|assistant|>"


def test_few_shot_examples_are_earlier_turns_through_the_same_instruction():
    tokenizer = tiny_tokenizer(CHAT_TEMPLATE)
    shots = (("What is 1 + 1?", "<answer>2</answer>"),)
    prompt = format_prompt(tokenizer, "What is 1 + 2?", "Q: {question}", "Be brief.", shots)
    assert prompt == (
        "<|system|>Be brief.\n<|user|>Q: What is 1 + 1?\n<|assistant|><answer>2</answer>\n"
        "<|user|>Q: What is 1 + 2?\n<|assistant|>"
    )
    assert format_prompt(tiny_tokenizer(None), "What is 1 + 2?", "Q: {question}", None, shots) == (
        "Q: What is 1 + 1?\n\n<answer>2</answer>\n\nQ: What is 1 + 2?\n"
    )


def test_task_few_shot_reaches_every_prompt_and_bad_examples_say_which():
    config = load_config(
        {"task": {"num_train": 4, "num_eval": 2, "few_shot": [{"question": "What is 1 + 1?", "response": "2"}]}}
    )
    task = make_task(config)
    assert task.few_shot == (("What is 1 + 1?", "2"),)
    prompt = task.prompts(tiny_tokenizer(CHAT_TEMPLATE), task.eval_rows[:1])[0]
    assert prompt.count("<|user|>") == 2 and "<|assistant|>2\n" in prompt
    with pytest.raises(ConfigError, match=r"task\.few_shot\[0\]\.response is empty"):
        make_task(load_config({"task": {"few_shot": [{"question": "q"}]}}))
    with pytest.raises(ConfigError, match=r"unknown config key 'task\.few_shot\[0\]\.answer'.*question, response"):
        load_config({"task": {"few_shot": [{"question": "q", "answer": "a"}]}})


def test_format_prompt_falls_back_to_plain_text_without_template():
    tokenizer = tiny_tokenizer(None)
    assert format_prompt(tokenizer, "What is 1 + 2?", "Q: {question}") == "Q: What is 1 + 2?\n"


def test_format_prompt_keeps_literal_braces():
    prompt = format_prompt(None, "Solve {x | x > 0}", 'Answer as {"a": 1}. {question}')
    assert prompt == 'Answer as {"a": 1}. Solve {x | x > 0}\n'


def test_format_prompt_rejects_template_without_placeholder():
    with pytest.raises(ValueError, match=r"'Solve it\.'.*\{question\}"):
        format_prompt(None, "What is 1 + 2?", "Solve it.")


def test_default_instruction_asks_for_tags():
    for tag in ("<think>", "</think>", "<answer>", "</answer>", "{question}"):
        assert tag in DEFAULT_INSTRUCTION
    assert "{question}" in PLAIN_INSTRUCTION


def test_task_prompts_follow_rows_and_default_to_task_instruction():
    task = arithmetic_task(num_train=3, num_eval=0)
    tokenizer = tiny_tokenizer(CHAT_TEMPLATE)
    prompts = task.prompts(tokenizer, task.train_rows)
    assert len(prompts) == 3
    for prompt, row in zip(prompts, task.train_rows):
        assert prompt.startswith("<|user|>" + row["question"])
        assert "final number" in prompt
    custom = task.prompts(tokenizer, task.train_rows[:1], "Q={question}", "sys")
    assert custom == [f"<|system|>sys\n<|user|>Q={task.train_rows[0]['question']}\n<|assistant|>"]


# ---------------------------------------------------------------- GSM8K


@needs_gsm8k
def test_gsm8k_real_files_parse():
    task = gsm8k_task(GSM8K_DIR / "train.jsonl", GSM8K_DIR / "test.jsonl")
    assert len(task.train_rows) == 7473 and len(task.eval_rows) == 1319
    first = task.train_rows[0]
    assert first["answer"] == "72"
    assert first["solution"].endswith("#### 72")
    assert first["question"].startswith("Natalia sold clips")
    assert all("," not in row["answer"] for row in task.train_rows + task.eval_rows)
    assert task.correctness("She sold 48 + 24 = 72 clips.", first) == 1.0
    assert task.correctness("She sold 70 clips.", first) == 0.0


@needs_gsm8k
def test_gsm8k_row_limits_take_the_first_rows():
    full = gsm8k_task(GSM8K_DIR / "train.jsonl", GSM8K_DIR / "test.jsonl")
    limited = gsm8k_task(GSM8K_DIR / "train.jsonl", GSM8K_DIR / "test.jsonl", num_train=10, num_eval=5)
    assert limited.train_rows == full.train_rows[:10]
    assert limited.eval_rows == full.eval_rows[:5]


def test_gsm8k_strips_thousands_commas_and_keeps_solution(tmp_path):
    solution = "Each costs 500.\nTwo cost 500*2 = <<500*2=1000>>1,000.\n#### 1,000"
    train = write_rows(tmp_path / "train.jsonl", [{"question": "How much?", "answer": solution}])
    task = gsm8k_task(train, train)
    row = task.train_rows[0]
    assert row == {"question": "How much?", "answer": "1000", "solution": solution}
    assert task.correctness("The total is $1,000.", row) == 1.0
    assert task.correctness("The total is \\boxed{1000}", row) == 1.0
    assert task.correctness("The total is 100", row) == 0.0


def test_gsm8k_answer_in_tags_requires_the_tag(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", [{"question": "q", "answer": "x\n#### -7"}])
    task = gsm8k_task(train, train, answer_in_tags=True)
    row = task.train_rows[0]
    assert task.correctness("<think>...</think><answer>-7</answer>", row) == 1.0
    assert task.correctness("the answer is -7", row) == 0.0


def test_gsm8k_bad_json_names_file_and_line(tmp_path):
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path = write_lines(tmp_path / "train.jsonl", [good, good, '{"question": "q", "answer": '])
    with pytest.raises(TaskDataError, match=r"train\.jsonl line 3: invalid JSON") as info:
        gsm8k_task(path, path)
    assert info.value.line == 3 and info.value.path == str(path)


def test_gsm8k_missing_final_answer_names_line(tmp_path):
    path = write_rows(
        tmp_path / "train.jsonl",
        [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "no mark here"}],
    )
    expected = r"train\.jsonl line 2: no '####' final answer in 'answer'"
    with pytest.raises(TaskDataError, match=expected):
        gsm8k_task(path, path)


def test_gsm8k_missing_field_names_field_and_present_fields(tmp_path):
    path = write_rows(tmp_path / "test.jsonl", [{"question": "q", "solution": "#### 1"}])
    expected = r"test\.jsonl line 1: missing field 'answer'.*\['question', 'solution'\]"
    with pytest.raises(TaskDataError, match=expected):
        gsm8k_task(path, path)


def test_gsm8k_line_numbers_count_blank_lines(tmp_path):
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path = write_lines(tmp_path / "train.jsonl", [good, "", "[1, 2]"])
    with pytest.raises(TaskDataError, match=r"line 3: expected a JSON object, got list"):
        gsm8k_task(path, path)


def test_gsm8k_missing_file_names_path(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        gsm8k_task(missing, missing)


def test_gsm8k_row_limit_larger_than_file_is_an_error(tmp_path):
    path = write_rows(tmp_path / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(ConfigError, match=r"task\.num_train is 5 but the file holds only 1 rows; set it to at most 1"):
        gsm8k_task(path, path, num_train=5)


# ---------------------------------------------------------------- user jsonl


def test_jsonl_renames_fields_and_keeps_others(tmp_path):
    path = write_rows(
        tmp_path / "data.jsonl",
        [
            {"problem": "2+2?", "target": 4, "level": 1},
            {"problem": "3+3?", "target": "6", "level": 2},
        ],
    )
    task = jsonl_task(path, path, prompt_field="problem", answer_field="target", checker="exact_number")
    assert task.train_rows == [  # the answer's own column stays, as it was (TRL-form rewards get it by its name)
        {"target": 4, "level": 1, "question": "2+2?", "answer": "4"},
        {"target": "6", "level": 2, "question": "3+3?", "answer": "6"},
    ]
    assert task.correctness("so 4", task.train_rows[0]) == 1.0


@pytest.mark.parametrize(
    ("checker", "completion", "expected"),
    [
        ("math_verify", "It is $\\frac{1}{2}$", 1.0),
        ("math_verify", "It is 0.5", 1.0),
        ("math_verify", "It is 0.25", 0.0),
        ("exact_string", "  <answer>1/2</answer>", 1.0),
        ("exact_string", "<answer>0.5</answer>", 0.0),
    ],
)
def test_jsonl_checkers(tmp_path, checker, completion, expected):
    path = write_rows(tmp_path / "data.jsonl", [{"question": "half?", "answer": "1/2"}])
    task = jsonl_task(path, path, checker=checker)
    assert task.correctness(completion, task.train_rows[0]) == expected


def test_jsonl_unknown_checker_names_valid_ones(tmp_path):
    path = write_rows(tmp_path / "data.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(
        ValueError,
        match=r"'fuzzy' is not a registered answer checker; registered: math_verify, exact_number, exact_string",
    ):
        jsonl_task(path, path, checker="fuzzy")


def test_jsonl_exact_number_rejects_non_numeric_answer_at_load(tmp_path):
    rows = [{"question": "q", "answer": "1"}, {"question": "q", "answer": "Paris"}]
    path = write_rows(tmp_path / "data.jsonl", rows)
    with pytest.raises(TaskDataError, match=r"data\.jsonl line 2: answer 'Paris' is not a number"):
        jsonl_task(path, path, checker="exact_number")


def test_jsonl_missing_prompt_field_names_it_and_present_keys(tmp_path):
    path = write_rows(tmp_path / "data.jsonl", [{"problem": "q", "answer": "1"}])
    expected = (
        r"data\.jsonl line 1: missing field 'question' \(or TRL's 'prompt'\); fields present: \['answer', 'problem'\]"
    )
    with pytest.raises(TaskDataError, match=expected):
        jsonl_task(path, path)
    with pytest.raises(TaskDataError, match=r"line 1: missing field 'text'; fields present"):
        jsonl_task(path, path, prompt_field="text")


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        (["a"], r"field 'question': message 0 must be a \{role, content\} mapping of strings, got 'a'"),
        ([], r"field 'question' is an empty list of messages"),
        (7, r"field 'question' must be a string or a list of \{role, content\} messages, got int 7"),
        ([{"role": "user", "content": " "}], r"field 'question' is empty"),
    ],
)
def test_jsonl_bad_prompt_is_rejected(tmp_path, prompt, problem):
    path = write_rows(tmp_path / "data.jsonl", [{"question": prompt, "answer": "1"}])
    with pytest.raises(TaskDataError, match=r"line 1: " + problem):
        jsonl_task(path, path)


def test_jsonl_empty_file_is_an_error(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [""])
    with pytest.raises(TaskDataError, match=r"data\.jsonl: file holds no rows"):
        jsonl_task(path, path)


# ---------------------------------------------------------------- registry


def test_registry_builds_each_task(tmp_path):
    assert set(TASKS) == {"arithmetic", "code", "gsm8k", "hf", "jsonl"}
    task = build_task("arithmetic", seed=2, num_train=10, num_eval=2)
    assert isinstance(task, Task) and task.name == "arithmetic"
    assert task.train_rows == arithmetic_task(seed=2, num_train=10, num_eval=2).train_rows
    path = write_rows(tmp_path / "d.jsonl", [{"question": "q", "answer": "#### 3"}])
    assert build_task("gsm8k", train_path=path, eval_path=path).train_rows[0]["answer"] == "3"
    assert build_task("jsonl", train_path=path, eval_path=path).name == "jsonl"


def test_registry_unknown_task_names_valid_ones():
    with pytest.raises(
        ValueError, match=r"'countdown' is not a registered task; registered: arithmetic, code, gsm8k, jsonl, hf"
    ):
        build_task("countdown")


def test_registry_unknown_option_names_accepted_ones():
    expected = r"task 'arithmetic' has no options \['digits'\].*'min_digits'"
    with pytest.raises(TypeError, match=expected):
        build_task("arithmetic", digits=3)


# ---------------------------------------------------------------- bad input, one clear error


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "1"}\n\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(
        TaskDataError, match=r"data\.jsonl line 3: not valid UTF-8 \(byte 0xe9 at byte 18 of the line\)"
    ) as info:
        read_jsonl(path)
    assert info.value.line == 3 and "\n" not in str(info.value)


def test_utf8_byte_order_mark_and_crlf_lines_are_read(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "caf\xc3\xa9", "answer": "1"}\r\n{"question": "q", "answer": "2"}\r\n')
    assert [row["question"] for _, row in read_jsonl(path)] == ["caf\u00e9", "q"]


def test_directory_as_data_file_is_named(tmp_path):
    with pytest.raises(TaskDataError, match="is a directory, not a jsonl file"):
        read_jsonl(tmp_path)


def _jsonl_config(tmp_path, *overrides):
    path = write_rows(tmp_path / "held_out.jsonl", [{"question": "q", "answer": "1"}, {"question": "r", "answer": "2"}])
    base = ["task.name=jsonl", f"task.train_path={path}", f"task.eval_path={path}", "task.num_train=null"]
    return load_config(None, [*base, *overrides, f"output.dir={tmp_path / 'run'}"])


def test_make_task_misspelled_checker_names_the_valid_ones(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^task\.checker: 'exact_nmber' is not a registered answer checker \(did you mean 'exact_number'\?\); "
        r"registered: math_verify, exact_number, exact_string \(or module:name for your own\)$",
    ):
        make_task(_jsonl_config(tmp_path, "task.checker=exact_nmber"))


def test_make_task_num_eval_beyond_the_held_out_file(tmp_path):
    with pytest.raises(ConfigError, match=r"held_out\.jsonl: task\.num_eval is 5 but the file holds only 2 rows"):
        make_task(_jsonl_config(tmp_path, "task.num_eval=5"))
    assert len(make_task(_jsonl_config(tmp_path, "task.num_eval=2")).eval_rows) == 2


def test_make_task_unknown_name_and_impossible_arithmetic(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^task\.name: 'jsnl' is not a registered task \(did you mean 'jsonl'\?\); registered: arithmetic, code, "
        r"gsm8k, jsonl, hf \(or module:name for your own\)$",
    ):
        make_task(load_config(None, ["task.name=jsnl"]))
    with pytest.raises(ConfigError, match=r"^task arithmetic: .*only 100\b"):
        make_task(load_config(None, ["task.min_digits=1", "task.max_digits=1", "task.num_train=200"]))


def test_unseen_train_rows_leave_out_every_held_out_question():
    from polo.data.base import Task

    rows = [{"question": q, "answer": "1"} for q in ("a", "b", "c", "b")]
    task = Task("toy", rows, [{"question": "b", "answer": "1"}], lambda completion, row: 0.0)
    assert [row["question"] for row in task.unseen_train_rows()] == ["a", "c"]
