"""`polo.sft`, `polo.rm` and `polo.dpo` take their training and held-out rows as Python objects (a list of dicts or a
`datasets.Dataset`) as well as jsonl paths: the same rows train the same model, a bad row is one error naming it,
and a resume goes on only with the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from safetensors.torch import load_file

import polo
from polo.config import ConfigError
from polo.data.base import TaskDataError


def demonstrations(count: int) -> list[dict]:
    return [{"prompt": f"What is {i} + 1?", "response": f"{i} + 1 = {i + 1}"} for i in range(count)]


def rankings(count: int) -> list[dict]:
    return [{"prompt": f"Say {i}.", "chosen": f"{i}", "rejected": f"{i}{i}{i} no"} for i in range(count)]


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def recipe(model_dir: Path, run_dir: Path, **data) -> dict:
    return {
        "model": {"name": str(model_dir)},
        "data": data,
        "train": {"max_steps": 2, "batch_size": 3, "micro_batch_size": 4, "learning_rate": 3e-3, "precision": "fp32"},
        "output": {"dir": str(run_dir), "report_to": [], "progress": False, "save_every": 1},
    }


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(result.model_dir / "model.safetensors"))


def test_sft_on_a_list_of_dicts_trains_the_model_the_same_rows_in_jsonl_files_train(tiny_model_dir, tmp_path):
    train, held_out = demonstrations(6), demonstrations(3)
    from_files = polo.sft(
        recipe(
            tiny_model_dir,
            tmp_path / "files",
            train_path=jsonl(tmp_path / "train.jsonl", train),
            eval_path=jsonl(tmp_path / "eval.jsonl", held_out),
        )
    )
    from_python = polo.sft(recipe(tiny_model_dir, tmp_path / "python"), train_dataset=train, eval_dataset=held_out)
    a, b = weights(from_files), weights(from_python)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert from_python.eval_after == from_files.eval_after
    text = (tmp_path / "python" / "config.yaml").read_text()
    assert yaml.safe_load(text)["data"]["train_path"] is None
    assert text.startswith("# data: rows passed from Python (train_dataset, eval_dataset), not read from a path")
    assert "6 train rows, 3 eval rows, rows sha256 " in text
    assert "trained with polo's sft" in (from_python.model_dir / "README.md").read_text()


@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_rm_and_dpo_train_on_a_datasets_dataset(tiny_model_dir, tmp_path, command):
    train = datasets.Dataset.from_list(rankings(6))
    held_out = datasets.Dataset.from_list(rankings(2))
    result = getattr(polo, command)(
        recipe(tiny_model_dir, tmp_path / "run"), train_dataset=train, eval_dataset=held_out
    )
    assert result.steps == 2 and result.eval_before is not None and result.eval_after is not None
    rows = [row for row in result.metrics if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2] and all(row["loss"] == row["loss"] for row in rows)


@pytest.mark.parametrize(
    ("command", "rows", "problem"),
    [
        (
            "sft",
            [*demonstrations(2), {"prompt": "Hi"}],
            "train_dataset row 2: missing field 'response'; fields present",
        ),
        ("dpo", [*rankings(1), {"prompt": "Hi", "chosen": "a"}], "train_dataset row 1: missing field 'rejected'"),
        ("rm", [rankings(1)[0], "not a row"], "train_dataset row 1: expected a dict of fields, got str"),
        ("sft", [], "train_dataset: holds no rows"),
    ],
)
def test_a_bad_row_is_one_error_that_names_it(tiny_model_dir, tmp_path, command, rows, problem):
    run = getattr(polo, command)
    with pytest.raises(TaskDataError) as error:
        run(recipe(tiny_model_dir, tmp_path / "run"), train_dataset=rows)
    assert str(error.value).startswith(problem) and "\n" not in str(error.value)


def test_a_split_from_a_path_and_from_python_at_once_is_refused(tiny_model_dir, tmp_path):
    config = recipe(tiny_model_dir, tmp_path / "run", train_path="train.jsonl")
    with pytest.raises(ConfigError) as error:
        polo.sft(config, train_dataset=demonstrations(2))
    assert str(error.value) == (
        "data.train_path is 'train.jsonl' and a train_dataset was passed too; pass one "
        "(data.train_path: null with train_dataset)"
    )
    with pytest.raises(ConfigError, match=r"^data.train_path is required: .* \(or, from Python, train_dataset=rows\)"):
        polo.dpo(recipe(tiny_model_dir, tmp_path / "run"), eval_dataset=rankings(2))


def test_a_resume_goes_on_only_with_the_same_rows(tiny_model_dir, tmp_path):
    config = recipe(tiny_model_dir, tmp_path / "run")
    straight = polo.sft(config, train_dataset=demonstrations(6))
    more = ["output.resume=true", "train.max_steps=3", "train.epochs=2"]
    with pytest.raises(ConfigError, match=r"^output.resume: the run in .* was trained on other rows \(sha256 "):
        polo.sft(config, more, train_dataset=demonstrations(7))
    resumed = polo.sft(config, more, train_dataset=datasets.Dataset.from_list(demonstrations(6)))
    assert straight.steps == 2 and resumed.steps == 3
