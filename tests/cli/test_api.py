"""The public API: every command is a `polo.X` function returning a result dataclass, and the CLI a thin layer."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import polo
from polo.cli import main
from polo.cli.commands import COMMANDS

SRC = Path(__file__).resolve().parents[2] / "src"
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
API = ("train", "sft", "rm", "dpo", "evaluate", "pipeline", "control")
QUIET = {"report_to": [], "progress": False}


def test_import_polo_is_cheap_and_every_command_is_an_attribute_with_a_docstring_and_example():
    program = (
        "import sys, polo; cheap = 'torch' not in sys.modules; "
        f"functions = [getattr(polo, name) for name in {API!r}]; "
        "print(cheap, all(callable(f) and (f.__doc__ or '').strip() for f in functions))"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True"]
    examples = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for name in API:
        assert f"polo.{name}(" in examples, name


def test_pipeline_and_control_stay_callable_after_their_submodules_are_imported():
    import polo.control.trainer
    import polo.pipeline.run

    assert polo.pipeline.__call__ is not None and callable(polo.pipeline) and callable(polo.control)
    assert polo.pipeline.run_pipeline is polo.pipeline.run.run_pipeline  # still the package, with its contents
    assert list(inspect.signature(polo.pipeline).parameters)[:2] == ["recipe", "overrides"]
    assert list(inspect.signature(polo.control).parameters)[:2] == ["config", "overrides"]
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        polo.trian  # noqa: B018


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"polo {polo.__version__}"


@pytest.mark.parametrize("command", ["train", "sft", "rm", "dpo", "control", "pipeline"])
def test_a_training_command_without_a_recipe_says_how_to_give_one(command, capsys):
    assert main([command]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "required" not in error
    example = error.split(", e.g. ")[1].split(" (")[0]  # "polo train recipes/grpo_arith.yaml"
    assert example.startswith(f"polo {command} recipes/") and (RECIPES.parent / example.split()[-1]).is_file()


def test_no_command_lists_the_commands(capsys):
    assert main([]) == 2
    error = capsys.readouterr().err
    assert all(name in error for name in COMMANDS.names()) and len(error.strip().splitlines()) == 1


def test_every_command_registers_itself_and_the_dispatcher_names_none():
    assert {"train", "sft", "rm", "dpo", "eval", "pipeline", "control", "config", "report"} <= set(COMMANDS.names())
    tree = ast.parse((SRC / "polo" / "cli" / "__init__.py").read_text())
    compared = {
        constant.value
        for compare in ast.walk(tree)
        if isinstance(compare, ast.Compare)
        for constant in ast.walk(compare)
        if isinstance(constant, ast.Constant) and isinstance(constant.value, str)
    }
    assert not compared & set(COMMANDS.names())  # no `if args.command == "train"` chain: the registry dispatches


# ---------------------------------------------------------------- each function on the tiny model


def test_polo_train_takes_a_mapping_python_rewards_and_datasets(tiny_model_dir, tmp_path):
    calls = []

    def shorter_is_better(completion: str, row: dict) -> float:
        calls.append(row["answer"])
        return -len(completion) / 10

    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    recipe = {
        "model": {"name": str(tiny_model_dir)},
        "task": {"num_eval": 2},
        "sampling": {"max_new_tokens": 4},
        "algorithm": {"group_size": 2},
        "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "precision": "fp32"},
        "eval": {"before": False, "max_new_tokens": 3, "batch_size": 4},
        "output": {"dir": str(tmp_path / "run"), "save_every": 0, "plots": False, **QUIET},
    }
    result = polo.train(
        recipe, ["train.learning_rate=0.001"], reward_functions={shorter_is_better: 1.0}, train_dataset=rows
    )
    assert type(result).__name__ == "TrainResult" and result.steps == 1
    assert len(calls) == 4 and set(calls) <= {row["answer"] for row in rows[:6]}  # 2 prompts x 2, training rows only
    assert result.eval_after is not None
    assert any("shorter_is_better" in key for row in result.metrics for key in row)  # its own reward column


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def finetune_recipe(model_dir: Path, tmp_path: Path, rows: list[dict]) -> dict:
    return {
        "model": {"name": str(model_dir)},
        "data": {"train_path": jsonl(tmp_path / "train.jsonl", rows)},
        "train": {"epochs": 1, "batch_size": 2, "micro_batch_size": 2, "precision": "fp32"},
        "output": {"dir": str(tmp_path / "run"), **QUIET},
    }


@pytest.mark.parametrize("name", ["sft", "rm", "dpo"])
def test_polo_sft_rm_and_dpo_train_from_a_mapping(name, tiny_model_dir, tmp_path):
    if name == "sft":
        rows = [{"prompt": f"What is {i} + 1?", "response": f"{i + 1}"} for i in range(4)]
    else:
        rows = [{"prompt": f"Say {i}.", "chosen": f"{i}", "rejected": f"{i}{i} no"} for i in range(4)]
    result = getattr(polo, name)(finetune_recipe(tiny_model_dir, tmp_path, rows), ["train.learning_rate=0.001"])
    assert type(result).__name__ == "FinetuneResult" and dataclasses.is_dataclass(result)
    assert result.steps == 2 and Path(result.model_dir, "config.json").is_file()


def test_polo_evaluate_scores_rows_passed_from_python(tiny_model_dir, tmp_path):
    from polo.evaluation.evaluate import EvalResult, EvalSettings

    rows = [{"question": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(5)]
    recipe = {"model": {"name": str(tiny_model_dir)}, "task": {"num_eval": None, "checker": "exact_number"}}
    settings = EvalSettings(samples=2, max_new_tokens=3, batch_size=4, progress=False)
    result = polo.evaluate(recipe, ["train.precision=fp32"], settings=settings, eval_dataset=rows)
    assert isinstance(result, EvalResult) and result.output is None
    assert [problem["reference"] for problem in result.problems] == [row["answer"] for row in rows]
    assert result.settings["task"] == "hf (exact_number)" and result.settings["max_new_tokens"] == 3
    assert set(result.summary["pass@k"]) == {"1", "2"} and 0 <= result.summary["pass@1"] <= 1


def test_polo_pipeline_runs_a_one_stage_recipe(tiny_model_dir, tmp_path):
    sft_stage = {
        "kind": "sft",
        "demos": {"num_train": 4},
        "train": {"batch_size": 4, "micro_batch_size": 4, "learning_rate": 1e-3, "precision": "fp32"},
        "output": dict(QUIET),
    }
    recipe = {
        "pipeline": {"dir": str(tmp_path / "pipe"), "model": str(tiny_model_dir), "progress": False},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 10, "num_eval": 2},
        "eval": {"enabled": False},
        "stages": {"cold_start": sft_stage},
    }
    result = polo.pipeline(recipe)
    assert type(result).__name__ == "PipelineResult"
    assert [stage.label for stage in result.stages] == ["a_cold_start"]


def test_polo_control_runs_a_recipe():
    result = polo.control(
        RECIPES / "a2c_cartpole.yaml", ["train.total_steps=64", "output.progress=false"], write_files=False
    )
    assert type(result).__name__ == "ControlResult" and result.env_steps >= 64
