"""`polo sft` and `polo dpo` with output.resume=true check the run before they load anything, as `polo train` does.

A recipe that changes a key that says what the run is (the model, the data, DPO's loss) is refused in
one line naming the key and both values, or, when `output.allow_changes` names it, goes on and is
recorded; a damaged newest checkpoint is named in one line and the run goes on from the intact one
before it; a checkpoint another command wrote is refused. Every case runs the real CLI
(`polo.cli.main`) on the tiny random model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_dpo import rankings_file
from test_sft import tiny_recipe

from polo.cli import main
from polo.finetune import dpo as dpo_module
from polo.finetune import sft as sft_module
from polo.runtime.metrics import read_metrics
from polo.runtime.resume import CHANGES_FILE


def dpo_recipe(model_dir: Path, folder: Path) -> dict:
    return {
        "model": {"name": str(model_dir)},
        "data": {"train_path": rankings_file(folder / "train.jsonl", 6)},
        "dpo": {"beta": 0.5},
        "train": {"batch_size": 2, "micro_batch_size": 4, "learning_rate": 3e-3, "precision": "fp32"},
        "output": {"dir": str(folder / "run"), "report_to": [], "progress": False, "save_every": 1},
    }


def sft_recipe(model_dir: Path, folder: Path) -> dict:
    recipe = tiny_recipe(model_dir, folder, train={"max_steps": 4}, output={"save_every": 2})
    del recipe["data"]["eval_path"]
    return recipe


RECIPES = {"sft": sft_recipe, "dpo": dpo_recipe}  # each: checkpoints at the last two steps (2 and 4, or 2 and 3)


@pytest.fixture(scope="module", params=sorted(RECIPES))
def finished(request, tiny_model_dir, tmp_path_factory) -> tuple[str, Path]:
    """(command, the folder of a finished run: recipe.yaml, run/ with two checkpoints) that each test copies."""
    command = request.param
    folder = tmp_path_factory.mktemp(command)
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPES[command](tiny_model_dir, folder)))
    assert main([command, str(recipe)]) == 0
    return command, folder


def copy_run(finished: tuple[str, Path], tmp_path: Path) -> tuple[str, Path, str]:
    """Return (command, a copy of the finished run under `tmp_path`, a recipe naming that copy as output.dir)."""
    command, folder = finished
    run_dir = shutil.copytree(folder / "run", tmp_path / "run")
    config = yaml.safe_load((folder / "recipe.yaml").read_text())
    config["output"]["dir"] = str(run_dir)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    return command, run_dir, str(recipe)


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step-*"))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()
    }


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured
    return captured.err.strip()


def no_model_load(monkeypatch) -> None:
    """Make loading any model fail loudly, so a test proves its refusal came first."""

    def refuse(self, source):
        raise AssertionError("the model was loaded")

    for trainer in (sft_module.SFTTrainer, dpo_module.DPOTrainer):
        monkeypatch.setattr(trainer, "load", refuse)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    weights = load_file(str(run_dir / "final" / "model.safetensors"))
    return {name: tensor.clone() for name, tensor in weights.items()}  # not views of a file a resume rewrites


@pytest.mark.parametrize("change", ["model.name", "data"])
def test_a_resume_that_changes_a_key_of_the_run_is_refused_in_one_line_before_loading_anything(
    finished, tmp_path, monkeypatch, capsys, change
):
    command, run_dir, recipe = copy_run(finished, tmp_path)
    was = yaml.safe_load(Path(recipe).read_text())
    key, value = ("model.name", "elsewhere/another-model") if change == "model.name" else ("data.num_train", 3)
    if change == "data" and command == "dpo":
        key, value = "dpo.beta", 0.25
    before = snapshot(run_dir)
    no_model_load(monkeypatch)
    assert main([command, recipe, "output.resume=true", f"{key}={value}"]) == 2
    section, name = key.split(".")
    old = was.get(section, {}).get(name)
    assert one_error_line(capsys) == (
        f"polo: error: cannot resume from {checkpoints(run_dir)[-1]}: the recipe changes what the run means "
        f"({key} was {old!r} in the run, {value!r} here); set it back, or say the change is meant with "
        f"output.allow_changes=[{key}] (it is recorded in {CHANGES_FILE})"
    )
    assert snapshot(run_dir) == before


def test_an_allowed_model_change_goes_on_is_recorded_and_never_claimed_for_the_whole_run(
    finished, tmp_path, capsys, tiny_model_dir
):
    command, run_dir, recipe = copy_run(finished, tmp_path)
    other = shutil.copytree(tiny_model_dir, tmp_path / "other-model")
    last = checkpoints(run_dir)[-1]
    steps = int(last.name.split("-")[1])
    more = "train.max_steps=6" if command == "sft" else "train.epochs=2"
    allow = ["output.allow_changes=[model.name]", f"model.name={other}", more]
    assert main([command, recipe, "output.resume=true", *allow]) == 0
    assert (
        f"polo: resuming from {last.name} with model.name {str(tiny_model_dir)!r} -> {str(other)!r}, as "
        f"output.allow_changes allows (recorded in {CHANGES_FILE})"
    ) in capsys.readouterr().out
    rows = [json.loads(line) for line in (run_dir / CHANGES_FILE).read_text().splitlines()]
    assert [(row["step"], row["key"], row["was"], row["now"]) for row in rows] == [
        (steps, "model.name", str(tiny_model_dir), str(other))
    ]
    text = (run_dir / "config.yaml").read_text()
    assert yaml.safe_load(text)["model"]["name"] == str(tiny_model_dir)  # the model the run started from
    assert f"# after step {steps} the run went on with model.name: {str(other)!r}" in text
    newest = checkpoints(run_dir)[-1]
    assert newest != last and yaml.safe_load((newest / "config.yaml").read_text())["model"]["name"] == str(other)
    card = (run_dir / "final" / "README.md").read_text()
    assert f"`{tiny_model_dir}`" in card and f"# after step {steps} the run went on with model.name" in card
    # the next resume compares with the newest checkpoint's recipe: the new model goes on without an allowance
    assert main([command, recipe, "output.resume=true", f"model.name={other}", more]) == 0
    assert len((run_dir / CHANGES_FILE).read_text().splitlines()) == 1


def test_a_truncated_newest_trainer_state_is_named_in_one_line_and_the_run_goes_on_from_the_intact_one(
    finished, tmp_path, capsys
):
    command, run_dir, recipe = copy_run(finished, tmp_path)
    uninterrupted = final_weights(run_dir)
    intact, newest = checkpoints(run_dir)[-2:]
    state = newest / "trainer_state.pt"
    with open(state, "r+b") as handle:
        handle.truncate(state.stat().st_size // 2)
    assert main([command, recipe, "output.resume=true"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    damaged = [line for line in captured.out.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith(
        f"polo: warning: checkpoint {newest} is damaged (trainer_state.pt cannot be read ("
    )
    assert damaged[0].endswith(f"; set aside as damaged-{newest.name}, resuming from {intact.name}")
    assert (run_dir / "checkpoints" / f"damaged-{newest.name}").is_dir()
    # the steps after the intact checkpoint again, from its exact state: the weights of the run before the damage
    steps = [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row]
    assert steps == list(range(1, int(newest.name.split("-")[1]) + 1))
    again = final_weights(run_dir)
    assert all(torch.equal(again[name], uninterrupted[name]) for name in uninterrupted)


def test_a_checkpoint_another_command_wrote_is_refused_in_one_line(finished, tmp_path, monkeypatch, capsys):
    command, run_dir, recipe = copy_run(finished, tmp_path)
    other = "rm"  # its recipe has the same sections as sft's; dpo's has one more
    config = yaml.safe_load(Path(recipe).read_text())
    config.pop("dpo", None)
    Path(recipe).write_text(yaml.safe_dump(config))
    before = snapshot(run_dir)
    assert main([other, recipe, "output.resume=true"]) == 2
    assert one_error_line(capsys) == (
        f"polo: error: cannot resume from {checkpoints(run_dir)[-1]}: polo {command} wrote it, this is polo rm; "
        "pick another output.dir, or start again there with output.overwrite=true"
    )
    assert snapshot(run_dir) == before
