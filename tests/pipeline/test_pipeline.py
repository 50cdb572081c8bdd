"""`polo pipeline` end to end on the tiny model: four chained stages, the report, skipping and continuing stages, the
GSM8K recipe."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml
from tiny_pipeline import QUIET, tiny_grpo, tiny_pipeline, tiny_sft

from polo.pipeline import rejection as rejection_module
from polo.pipeline import run_pipeline
from polo.rewards.format import r1_format
from polo.rl import train as trainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture
def pipeline_recipe(tiny_model_dir, tmp_path) -> dict:
    return tiny_pipeline(tiny_model_dir, tmp_path / "pipeline")


def stage_config(stage_dir: Path) -> dict:
    return yaml.safe_load((stage_dir / "config.yaml").read_text())


def mtimes(directory: Path) -> dict[str, float]:
    return {
        str(path.relative_to(directory)): path.stat().st_mtime_ns
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def accept_everything(monkeypatch) -> None:
    """Let rejection sampling keep the tiny random model's samples, so the SFT on them runs (it gets none right)."""
    real_select = rejection_module.select

    def lenient(completions, row, correctness, max_per_prompt):
        return real_select(completions, row, lambda *_: 1.0, max_per_prompt, well_formed=lambda *_: 1.0)

    monkeypatch.setattr(rejection_module, "select", lenient)


def test_all_four_stages_run_chained_and_the_report_has_the_stage_table(pipeline_recipe, monkeypatch, capsys):
    accept_everything(monkeypatch)
    root = Path(pipeline_recipe["pipeline"]["dir"])
    result = run_pipeline(pipeline_recipe)

    labels = ["a_cold_start", "b_reason", "c_reject", "d_reason2"]
    assert [stage.label for stage in result.stages] == labels and all(stage.ran for stage in result.stages)
    final = {stage.label: stage.model_dir for stage in result.stages}
    assert final["a_cold_start"] == str(root / "a_cold_start" / "final")
    assert final["b_reason"] == str(root / "b_reason" / "checkpoints" / "step-000002")
    assert final["c_reject"] == str(root / "c_reject" / "final")
    # each stage starts from the previous stage's final model
    assert stage_config(root / "a_cold_start")["model"]["name"] == pipeline_recipe["pipeline"]["model"]
    assert stage_config(root / "b_reason")["model"]["name"] == final["a_cold_start"]
    assert stage_config(root / "c_reject")["model"]["name"] == final["b_reason"]
    assert stage_config(root / "d_reason2")["model"]["name"] == final["c_reject"]

    demos = [json.loads(line) for line in (root / "a_cold_start" / "demos.jsonl").read_text().splitlines()]
    assert len(demos) == 8 and all(row["response"].startswith("<think>") for row in demos)
    summary = json.loads((root / "c_reject" / "rejection_summary.json").read_text())
    kept = (root / "c_reject" / "rejection.jsonl").read_text().splitlines()
    assert summary["sampled"] == 3 * 3 and summary["kept"] == len(kept) <= 3 * 2
    assert [entry["kept"] for entry in summary["per_prompt"]] == [
        min(entry["kept"], 2) for entry in summary["per_prompt"]
    ]

    for stage in result.stages:
        done = json.loads((stage.dir / "stage_done.json").read_text())
        assert done["model_dir"] == stage.model_dir
        assert done["evaluation"]["sampled"]["samples_per_problem"] == 2
        assert done["evaluation"]["greedy"]["samples_per_problem"] == 1
    assert (root / "b_reason" / "r1.png").exists() and (root / "d_reason2" / "r1.png").exists()
    assert result.base is not None and (root / "base" / "stage_eval.json").exists()

    page = (root / "report.html").read_text()
    assert "What each stage added" in page and "pass@1 over K" in page and "cons@K" in page
    for label in labels:
        assert f"<td>{label}</td>" in page
    assert page.count("data:image/png;base64,") == 1
    assert (root / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the same curves, to open on their own
    printed = capsys.readouterr().out
    assert "stage            kind" in printed and "d_reason2" in printed

    # run again: nothing is trained or evaluated again
    before = mtimes(root)
    again = run_pipeline(pipeline_recipe)
    assert not any(stage.ran for stage in again.stages)
    assert [stage.model_dir for stage in again.stages] == [stage.model_dir for stage in result.stages]
    printed = capsys.readouterr().out
    assert printed.count("already done; skipping it") == 4
    after = mtimes(root)
    changed = {name for name in after if before.get(name) != after[name]}
    assert changed <= {"pipeline.yaml", "report.html", "curves.png"}, changed


def two_stages(pipeline_recipe: dict, steps: int = 2) -> dict:
    recipe = {
        **pipeline_recipe,
        "stages": {"cold_start": pipeline_recipe["stages"]["cold_start"], "reason": tiny_grpo(steps)},
    }
    recipe["eval"] = {**recipe["eval"], "base": False}
    return recipe


def test_a_changed_stage_runs_again_and_so_does_every_stage_after_it(pipeline_recipe, capsys):
    recipe = two_stages(pipeline_recipe)
    root = Path(recipe["pipeline"]["dir"])
    run_pipeline(recipe)
    capsys.readouterr()
    cold_start_model = mtimes(root / "a_cold_start" / "final")

    result = run_pipeline(recipe, ["stages.reason.train.steps=3"])
    printed = capsys.readouterr().out
    assert "stage a_cold_start (sft) already done" in printed
    assert "stage b_reason (grpo) from" in printed and "(again: its recipe changed)" in printed
    assert [stage.ran for stage in result.stages] == [False, True]
    assert result.stages[1].model_dir.endswith("step-000003")
    assert mtimes(root / "a_cold_start" / "final") == cold_start_model

    result = run_pipeline(recipe, ["stages.reason.train.steps=3", "stages.cold_start.train.learning_rate=2e-3"])
    assert [stage.ran for stage in result.stages] == [True, True]
    printed = capsys.readouterr().out
    assert "(again: an earlier stage ran again)" in printed
    # the same model directory holds new weights: evaluated again, not taken from the earlier file
    assert f"evaluating {root / 'a_cold_start' / 'final'} on" in printed
    assert mtimes(root / "a_cold_start" / "final") != cold_start_model


def test_an_interrupted_grpo_stage_continues_from_its_checkpoint(pipeline_recipe, monkeypatch, capsys):
    recipe = two_stages(pipeline_recipe, steps=3)
    root = Path(recipe["pipeline"]["dir"])
    real_step, calls = trainer.rl_step, []

    def interrupting_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C during step 2: the step finishes, is saved, the run stops
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "rl_step", interrupting_step)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(recipe)
    monkeypatch.setattr(trainer, "rl_step", real_step)
    assert (root / "a_cold_start" / "stage_done.json").exists() and not (root / "b_reason" / "stage_done.json").exists()
    assert (root / "b_reason" / "checkpoints" / "step-000002" / "trainer_state.pt").exists()
    capsys.readouterr()

    result = run_pipeline(recipe)
    printed = capsys.readouterr().out
    assert "stage a_cold_start (sft) already done" in printed
    assert "(continuing)" in printed and "steps 2->3" in printed
    assert [stage.ran for stage in result.stages] == [False, True]
    steps = [
        row["step"]
        for row in map(json.loads, (root / "b_reason" / "metrics.jsonl").read_text().splitlines())
        if "reward/mean" in row
    ]
    assert steps == [1, 2, 3]


def write_gsm8k(path: Path, count: int, offset: int = 0) -> str:
    rows = []
    for index in range(offset, offset + count):
        apples, more = 3 + index, 2 + index % 5
        rows.append(
            {
                "question": f"Tom has {apples} apples and buys {more} more. How many apples does Tom have now?",
                "answer": f"Tom has {apples} + {more} = <<{apples}+{more}={apples + more}>>{apples + more} apples.\n"
                f"#### {apples + more}",
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_r1_gsm8k_recipe_runs_end_to_end_on_the_tiny_model(tiny_model_dir, tmp_path):
    sft_train = "train={epochs: 1, batch_size: 4, micro_batch_size: 4, learning_rate: 1.0e-3, precision: fp32}"
    grpo = (
        "train={steps: 1, prompts_per_step: 2, micro_batch_size: 4, learning_rate: 1.0e-3, precision: fp32}",
        "algorithm.group_size=2",
        "sampling.max_new_tokens=8",
        "eval={before: false, max_new_tokens: 6, batch_size: 4}",
    )
    quiet, rl_quiet = f"output={json.dumps(QUIET)}", f"output={json.dumps({**QUIET, 'save_every': 1})}"
    overrides = [
        f"pipeline.dir={tmp_path / 'r1_gsm8k'}",
        f"pipeline.model={tiny_model_dir}",
        "pipeline.progress=false",
        f"task.train_path={write_gsm8k(tmp_path / 'train.jsonl', 24)}",
        f"task.eval_path={write_gsm8k(tmp_path / 'test.jsonl', 6, 100)}",
        "task.num_eval=4",
        # DeepSeek's system prompt alone is longer than the tiny model's 512 positions: a short one stands in
        "task.system_prompt=Think in <think> tags, then answer in <answer> tags.",
        "eval={samples: 2, num_problems: 2, max_new_tokens: 6, batch_size: 8, precision: fp32}",
        "stages.cold_start.demos={num_train: 4, num_eval: 2}",
        "stages.cold_start.data.max_length=1500",
        f"stages.cold_start.{sft_train}",
        *(f"stages.{stage}.{override}" for stage in ("reason", "reason2") for override in (*grpo, rl_quiet)),
        "stages.reject.rejection={num_prompts: 2, samples: 2, max_new_tokens: 8}",
        "stages.reject.data.max_length=1500",
        f"stages.reject.{sft_train}",
        f"stages.cold_start.{quiet}",
        f"stages.reject.{quiet}",
    ]
    result = run_pipeline(RECIPES / "r1_gsm8k.yaml", overrides)
    assert [stage.label for stage in result.stages] == ["a_cold_start", "b_reason", "c_reject", "d_reason2"]
    demos = (tmp_path / "r1_gsm8k" / "a_cold_start" / "demos.jsonl").read_text()
    assert "<<" not in demos and "####" not in demos and "<think>" in demos
    # the random model gets nothing right: rejection sampling keeps nothing and passes b's model on
    assert result.stages[2].details["sft"] is None
    assert result.stages[2].model_dir == result.stages[1].model_dir
    assert stage_config(result.stages[3].dir)["model"]["name"] == result.stages[1].model_dir
    assert (tmp_path / "r1_gsm8k" / "report.html").exists()


@pytest.mark.parametrize("name", ["r1_arith.yaml", "r1_zero_arith.yaml", "r1_gsm8k.yaml"])
def test_the_r1_recipes_are_valid(name, tmp_path, monkeypatch):
    from polo.pipeline import load_pipeline

    # r1_gsm8k reads GSM8K from $POLO_GSM8K_DIR: rows in its format stand in for the data set, as many as
    # its cold-start demonstrations take (1,000 + 64)
    write_gsm8k(tmp_path / "train.jsonl", 1100)
    write_gsm8k(tmp_path / "test.jsonl", 6, 100)
    monkeypatch.setenv("POLO_GSM8K_DIR", str(tmp_path))
    plan = load_pipeline(RECIPES / name, ["task.num_eval=6"] if name == "r1_gsm8k.yaml" else [])
    assert plan.task.name in ("arithmetic", "gsm8k") and plan.instruction
    if name == "r1_gsm8k.yaml":  # for larger models on a GPU: DeepSeek's template
        assert plan.task_config.task.system_prompt.startswith("A conversation between User and Assistant.")
    else:  # SmolLM2-135M needs one worked example in the layout (docs/r1.md)
        ((question, response),) = plan.task.few_shot
        row = {"question": question, "answer": "42"}
        assert r1_format(response, row) == 1.0 and plan.task.correctness(response, row) == 1.0
    if name != "r1_zero_arith.yaml":
        assert [stage.kind for stage in plan.stages] == ["sft", "grpo", "reject_sft", "grpo"]


def test_sft_stage_with_user_demonstrations(pipeline_recipe, tmp_path):
    demos = tmp_path / "mine.jsonl"
    demos.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + 1?", "response": f"<think>{i}+1</think><answer>{i + 1}</answer>"})
            + "\n"
            for i in range(6)
        )
    )
    recipe = {
        **pipeline_recipe,
        "eval": {**pipeline_recipe["eval"], "enabled": False},
        "stages": {"warm": tiny_sft(data={"train_path": str(demos)})},
    }
    result = run_pipeline(recipe)
    assert result.base is None and result.stages[0].evaluation is None
    assert stage_config(result.stages[0].dir)["data"]["train_path"] == str(demos)
    assert Path(result.stages[0].model_dir, "config.json").exists()
