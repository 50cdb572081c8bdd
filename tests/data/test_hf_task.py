"""The hf task: Hugging Face datasets (files, saved datasets, Dataset objects) give the rows a jsonl file gives."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

import polo  # noqa: E402
from polo.cli import main  # noqa: E402
from polo.config import ConfigError, load_config  # noqa: E402
from polo.data import TASKS, HfSource, hf_task, jsonl_task, make_task  # noqa: E402
from polo.data.base import TaskDataError  # noqa: E402
from polo.rewards.answers import CHECKERS, DEFAULT_CHECKER  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "rl"))
from test_trainer import tiny_config, without_times  # noqa: E402

# A user's own task, subtraction: answers are JSON numbers (negative ones too), and an extra field rides along.
TRAIN = [
    {"question": f"What is {a} - {b}?", "answer": a - b, "level": a % 3} for a, b in zip(range(2, 14), range(9, 0, -1))
]
TEST = [{"question": f"What is {a} - {b}?", "answer": a - b, "level": 0} for a, b in ((20, 3), (4, 11), (7, 7))]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Keep datasets' arrow cache in the test's folder, not the user's home."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def subtraction_jsonl(root: Path) -> tuple[Path, Path]:
    return write_jsonl(root / "jsonl" / "train.jsonl", TRAIN), write_jsonl(root / "jsonl" / "test.jsonl", TEST)


def subtraction_files(root: Path, form: str) -> Path:
    """Return a task.path holding the subtraction rows as a train and a test split, in the datasets form `form`."""
    train, test = datasets.Dataset.from_list(TRAIN), datasets.Dataset.from_list(TEST)
    folder = root / f"{form}-files"
    if form == "save_to_disk":
        datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
        return folder
    folder.mkdir(parents=True)
    write = {"parquet": "to_parquet", "csv": "to_csv", "jsonl": "to_json"}[form]
    for name, split in (("train", train), ("test", test)):
        getattr(split, write)(str(folder / f"{name}.{form}"))
    return folder


# ---------------------------------------------------------------- one row contract


@pytest.mark.parametrize("form", ["parquet", "save_to_disk", "csv", "jsonl"])
def test_datasets_files_give_the_jsonl_rows(tmp_path, form):
    train, test = subtraction_jsonl(tmp_path)
    expected = jsonl_task(train, test)
    task = hf_task(HfSource(str(subtraction_files(tmp_path, form))))
    assert task.name == "hf"
    assert task.train_rows == expected.train_rows and task.eval_rows == expected.eval_rows
    assert task.train_rows[0] == {"level": 2, "question": "What is 2 - 9?", "answer": "-7"}


def test_one_data_file_with_eval_path(tmp_path):
    folder = subtraction_files(tmp_path, "parquet")
    expected = jsonl_task(*subtraction_jsonl(tmp_path))
    task = hf_task(HfSource(str(folder / "train.parquet"), eval_path=str(folder / "test.parquet")))
    assert (task.train_rows, task.eval_rows) == (expected.train_rows, expected.eval_rows)


@pytest.mark.parametrize("as_dataset", [True, False], ids=["Dataset", "list"])
def test_passed_datasets_give_the_jsonl_rows(tmp_path, as_dataset):
    expected = jsonl_task(*subtraction_jsonl(tmp_path))
    wrap = datasets.Dataset.from_list if as_dataset else list
    task = hf_task(HfSource(train_dataset=wrap(TRAIN), eval_dataset=wrap(TEST)))
    assert (task.train_rows, task.eval_rows) == (expected.train_rows, expected.eval_rows)


@pytest.mark.parametrize(
    "bad_row, problem",
    [
        ({"question": "", "answer": 1}, "field 'question' is empty"),
        ({"question": "What?", "answer": " "}, "field 'answer' is empty"),
        (
            {"question": 5, "answer": 1},
            "field 'question' must be a string or a list of {role, content} messages, got int 5",
        ),
        ({"question": "What?", "answer": None}, "field 'answer' must be a string or a number, got NoneType None"),
        ({"question": "What?", "answer": True}, "field 'answer' must be a string or a number, got bool True"),
    ],
)
def test_a_bad_row_is_the_same_error_from_jsonl_and_from_datasets(tmp_path, bad_row, problem):
    rows = [TRAIN[0], TRAIN[1], bad_row]
    with pytest.raises(TaskDataError) as from_jsonl:
        jsonl_task(write_jsonl(tmp_path / "train.jsonl", rows), write_jsonl(tmp_path / "test.jsonl", TEST))
    with pytest.raises(TaskDataError) as from_list:
        hf_task(HfSource(train_dataset=rows, eval_dataset=TEST))
    assert from_jsonl.value.problem == from_list.value.problem == problem
    assert str(from_jsonl.value).endswith(f"train.jsonl line 3: {problem}")
    assert str(from_list.value) == f"train_dataset row 2: {problem}"


def test_a_bad_row_of_a_dataset_file_names_split_row_and_field(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    datasets.Dataset.from_list([*TRAIN[:4], {"question": "  ", "answer": 1, "level": 0}]).to_parquet(
        str(folder / "train.parquet")
    )
    with pytest.raises(TaskDataError) as error:
        hf_task(HfSource(str(folder)), num_eval=1)
    assert str(error.value) == f"{folder} split 'train' row 4: field 'question' is empty"
    assert (error.value.line, error.value.unit) == (4, "row") and "\n" not in str(error.value)


def test_a_missing_column_names_the_setting_and_the_columns(tmp_path):
    with pytest.raises(ConfigError) as error:
        hf_task(HfSource(train_dataset=datasets.Dataset.from_list(TRAIN)), prompt_field="prompt")
    assert (
        str(error.value)
        == "train_dataset: no column 'prompt' (task.prompt_field); its columns: ['question', 'answer', 'level']"
    )
    with pytest.raises(
        TaskDataError,
        match=r"^train_dataset row 1: missing field 'question' \(or TRL's 'prompt'\); "
        r"fields present: \['answer', 'q'\]$",
    ):
        hf_task(HfSource(train_dataset=[TRAIN[0], {"q": "What?", "answer": 1}]))


def test_exact_number_needs_numeric_answers_from_datasets_too(tmp_path):
    rows = [*TRAIN[:2], {"question": "Capital of France?", "answer": "Paris"}]
    with pytest.raises(
        TaskDataError, match=r"^train_dataset row 2: answer 'Paris' is not a number, which checker 'exact_number' needs"
    ):
        hf_task(HfSource(train_dataset=rows), num_eval=0, checker="exact_number")


# ---------------------------------------------------------------- splits


def test_no_test_split_holds_out_the_last_num_eval_rows(tmp_path):
    folder = tmp_path / "train-only"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN)}).save_to_disk(str(folder))
    task = hf_task(HfSource(str(folder)), num_eval=3, num_train=5, checker="exact_number")
    expected = jsonl_task(*subtraction_jsonl(tmp_path), checker="exact_number")
    assert task.eval_rows == expected.train_rows[-3:] and task.train_rows == expected.train_rows[:5]
    assert hf_task(HfSource(train_dataset=TRAIN), num_eval=3).eval_rows == task.eval_rows
    assert hf_task(HfSource(str(folder)), num_eval=0).eval_rows == [] and len(
        hf_task(HfSource(str(folder))).train_rows
    ) == len(TRAIN)
    with pytest.raises(
        ConfigError,
        match=rf"^task\.num_eval is {len(TRAIN)} but .* holds only {len(TRAIN)} rows and there is no eval split",
    ):
        hf_task(HfSource(str(folder)), num_eval=len(TRAIN))


def test_split_settings_name_the_splits_there_are(tmp_path):
    folder = subtraction_files(tmp_path, "save_to_disk")
    assert (
        hf_task(HfSource(str(folder), split="test", eval_split="train")).train_rows[0]["question"] == "What is 20 - 3?"
    )
    with pytest.raises(
        ConfigError, match=r"^task\.split: 'training' is not a split of .*; its splits: \['test', 'train'\]$"
    ):
        hf_task(HfSource(str(folder), split="training"))
    with pytest.raises(
        ConfigError, match=r"^task\.eval_split: 'validation' is not a split of .*; its splits: \['test', 'train'\]"
    ):
        hf_task(HfSource(str(folder), eval_split="validation"))
    with pytest.raises(ConfigError, match=r"^task\.eval_split: 'train' is also task\.split"):
        hf_task(HfSource(str(folder), eval_split="train"))
    with pytest.raises(
        ConfigError, match=r"^hf eval .* split 'test': task\.num_eval is 5 but the dataset holds only 3 rows"
    ):
        hf_task(HfSource(str(folder)), num_eval=5)


def test_paths_that_are_not_datasets_fail_at_once(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^task\.path: .*missing\.parquet is neither a local file or directory nor a Hugging Face Hub",
    ):
        hf_task(HfSource(str(tmp_path / "missing.parquet")))
    text = write_jsonl(tmp_path / "notes.txt", TRAIN)
    with pytest.raises(
        ConfigError,
        match=r"^task\.path: .*notes\.txt is not a data file datasets reads; use one ending in \.parquet, \.json",
    ):
        hf_task(HfSource(str(text)))
    broken = tmp_path / "broken.json"
    broken.write_text('{"question": "What?", "answer": ')
    with pytest.raises(TaskDataError, match=r"broken\.json: datasets could not read it"):
        hf_task(HfSource(str(broken)))
    with pytest.raises(ConfigError, match=r"^task\.path: the hf task needs a dataset"):
        hf_task()


def test_passed_datasets_are_checked(tmp_path):
    whole = datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN)})
    with pytest.raises(ConfigError, match=r"^train_dataset is a mapping \(splits \['train'\]\); pass one split"):
        hf_task(HfSource(train_dataset=whole))
    with pytest.raises(
        ConfigError, match=r"^train_dataset must be a datasets\.Dataset or a list of dicts, got IterableDataset"
    ):
        hf_task(HfSource(train_dataset=datasets.Dataset.from_list(TRAIN).to_iterable_dataset()))
    with pytest.raises(ConfigError, match=r"^task\.path is 'data' and a train_dataset was passed too"):
        hf_task(HfSource("data", train_dataset=TRAIN))
    with pytest.raises(ConfigError, match=r"^eval_dataset was passed without train_dataset"):
        hf_task(HfSource("data", eval_dataset=TEST))


# ---------------------------------------------------------------- from a config


def test_make_task_from_a_config_and_from_passed_datasets(tmp_path):
    folder = subtraction_files(tmp_path, "parquet")
    config = load_config({"task": {"name": "hf", "path": str(folder), "num_eval": None, "checker": "exact_number"}})
    expected = jsonl_task(*subtraction_jsonl(tmp_path))
    assert make_task(config).train_rows == expected.train_rows
    default = load_config({"task": {"num_eval": None}})  # task.name left at its default: the datasets make it hf
    task = make_task(default, datasets.Dataset.from_list(TRAIN), TEST)
    assert task.name == "hf" and (task.train_rows, task.eval_rows) == (expected.train_rows, expected.eval_rows)
    with pytest.raises(
        ConfigError, match=r"^task\.name is 'jsonl' but train_dataset was passed; datasets make the hf task"
    ):
        make_task(load_config({"task": {"name": "jsonl", "train_path": "t.jsonl", "eval_path": "e.jsonl"}}), TRAIN)
    with pytest.raises(
        ConfigError, match=r"^task\.checker: 'exact' is not a registered answer checker; registered: math_verify, "
    ):
        make_task(load_config({"task": {"name": "hf", "path": str(folder), "checker": "exact"}}))


# ---------------------------------------------------------------- checker names where users look


def test_train_help_lists_every_checker_and_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default {DEFAULT_CHECKER}" in text and "math_verify (default):" in text
    for entry in CHECKERS.entries():
        assert entry.help and f"{entry.name}" in text and " ".join(entry.help.split()) in text
    assert all(name in text for name in TASKS)
    assert load_config({}).task.checker == DEFAULT_CHECKER


def test_the_tasks_guide_lists_every_checker_beside_the_jsonl_example():
    readme = (Path(__file__).parents[2] / "docs" / "tasks.md").read_text()
    for name in CHECKERS:
        assert f"`{name}`" in readme
    example = readme.index("name: jsonl")
    assert "math_verify" in readme[example - 600 : example + 900] and "default" in readme[example - 600 : example + 900]


# ---------------------------------------------------------------- training: the same first step either way


def row_reward(completion: str, row: dict) -> float:
    """A reward that reads the row (its answer and its extra field) and the completion, so that rewards,
    advantages, loss and gradients differ from zero and depend on exactly which rows were drawn (the
    tiny random model never answers right, which alone would leave every metric at 0)."""
    return ((len(completion) + int(row["answer"]) + row["level"]) % 3) / 2


def one_step(model_dir: Path, output_dir: Path, task: dict | None = None, **datasets_passed) -> list[dict]:
    """Train one step on the tiny model and return its metrics rows, timings left out."""
    config = tiny_config(
        model_dir,
        output_dir,
        train={"steps": 1},
        eval={"before": False, "after": False},
        output={"save_every": 0, "report_to": [], "plots": False},
    )
    config["task"] = task or {"num_eval": None}
    result = polo.train(config, reward_functions={row_reward: 1.0}, **datasets_passed)
    return without_times(result.metrics)


def test_first_step_metrics_match_from_jsonl_parquet_and_a_dataset(tiny_model_dir, tmp_path):
    train, test = subtraction_jsonl(tmp_path)
    common = {"num_eval": None, "checker": "exact_number"}
    from_jsonl = one_step(
        tiny_model_dir,
        tmp_path / "jsonl-run",
        {"name": "jsonl", "train_path": str(train), "eval_path": str(test), **common},
    )
    parquet = subtraction_files(tmp_path, "parquet")
    from_parquet = one_step(tiny_model_dir, tmp_path / "parquet-run", {"name": "hf", "path": str(parquet), **common})
    from_dataset = one_step(
        tiny_model_dir,
        tmp_path / "dataset-run",
        common,
        train_dataset=datasets.Dataset.from_list(TRAIN),
        eval_dataset=datasets.Dataset.from_list(TEST),
    )
    assert len(from_jsonl) == 1 and from_jsonl[0]["reward/mean"] > 0 and from_jsonl[0]["grad_norm"] > 0
    assert from_parquet == from_jsonl and from_dataset == from_jsonl
    samples = [(tmp_path / run / "samples.jsonl").read_text() for run in ("jsonl-run", "parquet-run", "dataset-run")]
    assert samples[0] and samples[0] == samples[1] == samples[2]


def test_passed_datasets_are_recorded_and_resume_needs_them_again(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    one_step(tiny_model_dir, run_dir, None, train_dataset=datasets.Dataset.from_list(TRAIN), eval_dataset=TEST)
    text = (run_dir / "config.yaml").read_text()
    assert text.startswith("# task: rows from datasets passed to polo.train") and "rows sha256 " in text
    recorded = load_config(str(run_dir / "config.yaml"))  # still a valid recipe
    assert (recorded.task.name, recorded.task.path) == ("hf", None)
    resume = ["output.resume=true", "train.steps=2", "eval.before=false", "eval.after=false"]
    with pytest.raises(ConfigError, match=r"^task\.path: the hf task needs a dataset.*pass the same ones again"):
        polo.train(str(run_dir / "config.yaml"), resume)
    with pytest.raises(ConfigError, match=r"^output\.resume: the run in .* was trained on other rows"):
        polo.train(str(run_dir / "config.yaml"), resume, train_dataset=TRAIN[:-1], eval_dataset=TEST)
    result = polo.train(str(run_dir / "config.yaml"), resume, train_dataset=TRAIN, eval_dataset=TEST)
    assert [row["step"] for row in result.metrics] == [1, 2]
