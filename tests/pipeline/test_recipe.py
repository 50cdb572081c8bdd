"""A pipeline recipe is checked whole before any stage runs; every mistake is one line naming the key and what is
valid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_pipeline import tiny_grpo, tiny_pipeline, tiny_sft

from polo.config import ConfigError
from polo.pipeline import load_pipeline

POLO = Path(sys.executable).with_name("polo")


@pytest.fixture
def recipe(tmp_path) -> dict:
    # A model that does not exist: every error below must come before any model is looked at.
    return tiny_pipeline(tmp_path / "no-model-here", tmp_path / "pipeline")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["stage.reason.kind=grpo"], "unknown pipeline recipe key 'stage'; valid keys: pipeline, task, eval, stages"),
        (
            ["pipeline.dri=runs/x"],
            "unknown config key 'pipeline.dri'; valid keys in pipeline: dir, model, report, progress, threads",
        ),
        (
            ["eval.sample=4"],
            "unknown config key 'eval.sample' (did you mean 'samples'?); valid keys in eval: enabled, base, samples,",
        ),
        (
            ["stages.reason.trian.steps=3"],
            "stages.reason: unknown key 'trian' for a grpo stage; valid keys: kind, recipe, overrides, model, task,",
        ),
        (["stages.reason.kind=ppo"], "stages.reason.kind: 'ppo' is not one of sft, grpo, reject_sft"),
        (
            ["stages.reason.train.stepz=3"],
            "stages.reason: unknown config key 'train.stepz' (did you mean 'steps'?); valid keys in train: "
            "learning_rate, weight_decay,",
        ),
        (["stages.reason.train.steps=-1"], "stages.reason: train.steps must be at least 0, got -1"),
        (
            ["stages.reject.demos.num_train=3"],
            "stages.reject: unknown key 'demos' for a reject_sft stage; valid keys: kind, recipe, overrides, model, "
            "data, train, output, rejection",
        ),
        (
            ["stages.cold_start.demos.num_trian=3"],
            "stages.cold_start.demos: unknown config key 'num_trian' (did you mean 'num_train'?); valid keys: "
            "num_train, num_eval, seed",
        ),
        (
            ["stages.cold_start.demos.num_train=60"],
            "stages.cold_start.demos: num_train + num_eval = 62 must fit the task's 40 training rows",
        ),
        (
            ["stages.reject.rejection.num_prompts=41"],
            "stages.reject.rejection.num_prompts=41 is more than the task's 40 training rows",
        ),
        (
            ["stages.reject.rejection.max_per_prompt=0"],
            "stages.reject.rejection.max_per_prompt must be at least 1, got 0",
        ),
        (
            ["stages.reason2.model.name=other"],
            "stages.reason2.model.name: a later stage starts from the previous stage's final model",
        ),
        (["stages.reason.train=5"], "stages.reason.train: expected a mapping of train settings, got 5"),
        (["stages=null"], "the pipeline recipe has no stages"),
        (
            ["stages.cold_start=null", "stages.reason=null", "stages.reject=null", "stages.reason2=null"],
            "stages: the pipeline has no stages",
        ),
        (["task.name=arith"], "task.name: 'arith' is not a registered task; registered: arithmetic,"),
        (["eval.samples=0"], "eval.samples must be at least 1, got 0"),
    ],
)
def test_a_bad_recipe_names_the_key(recipe, overrides, expected):
    with pytest.raises(ConfigError) as raised:
        load_pipeline(recipe, overrides)
    assert expected in str(raised.value)
    assert "\n" not in str(raised.value)


def test_cold_start_needs_demonstrations_for_a_task_without_built_in_ones(recipe, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "2+2?", "answer": 4}\n' * 3)
    recipe["task"] = {
        "name": "jsonl",
        "train_path": str(data),
        "eval_path": str(data),
        "num_eval": 3,
        "answer_in_tags": True,
    }
    recipe["stages"] = {"cold_start": tiny_sft(), "reason": tiny_grpo()}
    with pytest.raises(
        ConfigError, match="task 'jsonl' has no built-in cold-start demonstrations .*set data.train_path"
    ):
        load_pipeline(recipe)


def test_stages_as_a_list_or_mapping_left_out_stages_and_directories(recipe):
    plan = load_pipeline(recipe, ["stages.reject=null"])
    assert [stage.label for stage in plan.stages] == ["a_cold_start", "b_reason", "c_reason2"]
    assert plan.stages[1].body["output"]["dir"] == str(Path(recipe["pipeline"]["dir"]) / "b_reason")
    assert plan.stages[1].body["task"]["answer_in_tags"] is True  # the pipeline's task reaches grpo stages
    as_list = {**recipe, "stages": [{"name": name, **stage} for name, stage in recipe["stages"].items()]}
    listed = load_pipeline(as_list)
    assert [(stage.label, stage.body) for stage in listed.stages] == [
        (stage.label, stage.body) for stage in load_pipeline(recipe).stages
    ]


def test_a_stage_from_a_recipe_file_keeps_the_chain_and_yaml_anchors_are_not_shared(recipe, tmp_path):
    file = tmp_path / "grpo.yaml"
    file.write_text(
        yaml.safe_dump(
            {"model": {"name": "elsewhere"}, "train": {"steps": 7, "learning_rate": 1e-4}, "output": {"dir": "runs/x"}}
        )
    )
    recipe["stages"]["reason"] = {
        "kind": "grpo",
        "recipe": str(file),
        "overrides": ["train.steps=5"],
        "train": {"prompts_per_step": 2},
    }
    shared = {"max_new_tokens": 8}
    recipe["stages"]["reason2"]["sampling"] = shared
    recipe["stages"]["reason"]["sampling"] = shared  # as a YAML anchor would make them
    plan = load_pipeline(recipe, ["stages.reason.sampling.max_new_tokens=12"])
    reason, reason2 = plan.stages[1], plan.stages[3]
    config = reason.config("the-previous-model")
    assert config.train.steps == 5 and config.train.learning_rate == 1e-4 and config.train.prompts_per_step == 2
    assert config.model.name == "the-previous-model" and config.output.dir == str(reason.dir)
    assert reason.body["sampling"]["max_new_tokens"] == 12 and reason2.body["sampling"]["max_new_tokens"] == 8
    assert plan.start_model == recipe["pipeline"]["model"]
    assert load_pipeline(recipe, ["stages.cold_start.model.name=first"]).start_model == "first"


def polo_error(*args: str, cwd: Path) -> str:
    """Run `polo args...`; assert it failed with exactly one line on stderr and return that line."""
    result = subprocess.run([str(POLO), *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("polo: error: ")
    return lines[0].removeprefix("polo: error: ")


def test_the_command_line_says_one_line(recipe, tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(recipe))
    message = polo_error("pipeline", str(path), "stages.reason.train.stepz=3", cwd=tmp_path)
    assert message.startswith(
        "stages.reason: unknown config key 'train.stepz' (did you mean 'steps'?); valid keys in train: learning_rate,"
    )
    assert (
        polo_error("pipeline", str(tmp_path / "missing.yaml"), cwd=tmp_path)
        == f"recipe {tmp_path / 'missing.yaml'} does not exist"
    )
    assert not (tmp_path / "pipeline").exists()  # nothing ran, nothing was written


def test_stages_report_to_the_pipeline_s_trackers_and_one_store(recipe):
    for stage in recipe["stages"].values():
        stage["output"].pop("report_to")
    plan = load_pipeline(
        recipe, ["pipeline.report_to=[mlflow]", "pipeline.project=r1", "stages.reason.output.report_to=[]"]
    )
    outputs = {stage.name: stage.body["output"] for stage in plan.stages}
    name = Path(plan.settings.dir).resolve().name
    assert outputs["cold_start"]["report_to"] == ["mlflow"] and outputs["reason"]["report_to"] == []  # its own wins
    for stage in plan.stages:
        config = stage.config(plan.start_model)
        assert (config.output.project, config.output.run_name) == ("r1", f"{name}-{stage.label}")
        assert config.output.tracker_dir == plan.settings.dir


def test_a_finished_stage_stays_done_across_a_polo_upgrade(recipe):
    """A record written before a setting existed (or after one was removed) still matches; a real change does not."""
    import copy
    import json

    from polo.pipeline.recipe import same_record, stage_record

    plan = load_pipeline(recipe)
    for stage in plan.stages:
        record = json.loads(json.dumps(stage_record(stage, stage.config(plan.start_model)), default=str))
        older = copy.deepcopy(record)
        del older["config"]["train"]["adam_eps"]  # a setting polo added since, at its default
        older["config"]["output"]["tensorboard"] = True  # a setting polo removed since
        assert same_record(older, record) and same_record(record, record)
        changed = copy.deepcopy(record)
        changed["config"]["train"]["learning_rate"] *= 2
        assert not same_record(changed, record)
        changed = copy.deepcopy(older)
        record["config"]["train"]["adam_eps"] = 1e-6  # an added setting away from its default is a change
        assert not same_record(changed, record)
