"""`polo train output.resume=true` checks the run before it loads anything, and the edges of a run directory.

A resume whose recipe changes what the run means is refused in one line (or, when the recipe says
the change is meant, goes on and records it); a damaged newest checkpoint is named and the run goes
on from the newest intact one; a finished run says so; `train.steps=0` does nothing; a run that
never finished a step is no run to protect; an output directory that cannot be written is one line.
Every case runs the real CLI (`polo.cli.main`, or the `polo` executable) on the tiny random model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_data_safety import no_model_load, snapshot
from test_trainer import tiny_config

from polo.cli import main
from polo.runtime.metrics import read_metrics
from polo.runtime.resume import CHANGES_FILE

POLO = Path(sys.executable).with_name("polo")


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4, the final evaluation) that each test copies."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    config = tiny_config(tiny_model_dir, run_dir, eval={"before": False}, output={"plots": False, "report_to": []})
    recipe = run_dir.parent / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    assert main(["train", str(recipe)]) == 0
    return run_dir


def copy_run(finished_run: Path, tmp_path: Path) -> tuple[Path, str]:
    """Return (a copy of the finished run under `tmp_path`, a recipe that names that copy as output.dir)."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    config = yaml.safe_load((finished_run.parent / "recipe.yaml").read_text())  # the recipe the run started from
    config["output"]["dir"] = str(run_dir)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    return run_dir, str(recipe)


def training_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row]


def one_error_line(capsys) -> str:
    """Return the one line polo wrote to stderr, after checking that stdout is empty and there is no traceback."""
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured
    return captured.err.strip()


# ------------------------------------------------------------------ a recipe that changes what the run means


@pytest.mark.parametrize(
    ("key", "value", "was"),
    [
        ("model.name", "elsewhere/another-model", None),  # None: the tiny model's directory
        ("algorithm.group_size", 2, 4),
        ("algorithm.policy_loss", "gspo", "ppo_clip"),
        ("algorithm.loss_aggregation", "token_mean", "seq_mean_token_mean"),
        ("task.name", "code", "arithmetic"),
    ],
)
def test_a_resume_that_changes_a_key_of_the_run_is_refused_in_one_line_before_loading_anything(
    finished_run, tmp_path, monkeypatch, capsys, key, value, was, tiny_model_dir
):
    run_dir, recipe = copy_run(finished_run, tmp_path)
    before = snapshot(run_dir)
    no_model_load(monkeypatch)
    assert main(["train", recipe, "output.resume=true", "train.steps=6", f"{key}={value}"]) == 2
    was = str(tiny_model_dir) if was is None else was
    assert one_error_line(capsys) == (
        f"polo: error: cannot resume from {run_dir / 'checkpoints' / 'step-000004'}: the recipe changes what the run "
        f"means ({key} was {was!r} in the run, {value!r} here); set it back, or say the change is meant with "
        f"output.allow_changes=[{key}] (it is recorded in {CHANGES_FILE})"
    )
    assert snapshot(run_dir) == before


def test_a_preset_that_changes_several_registered_parts_names_each_in_the_one_line(finished_run, tmp_path, capsys):
    _, recipe = copy_run(finished_run, tmp_path)
    assert main(["train", recipe, "output.resume=true", "train.steps=6", "algorithm.name=dr_grpo"]) == 2
    line = one_error_line(capsys)
    assert "algorithm.name was 'grpo' in the run, 'dr_grpo' here; " in line
    assert "algorithm.loss_aggregation was 'seq_mean_token_mean' in the run, 'seq_mean_token_sum_norm' here" in line
    assert line.endswith(
        "output.allow_changes=[algorithm.name,algorithm.loss_aggregation] (it is recorded in config_changes.jsonl)"
    )


def test_an_allowed_change_goes_on_is_recorded_and_never_claimed_for_the_whole_run(
    finished_run, tmp_path, capsys, tiny_model_dir
):
    run_dir, recipe = copy_run(finished_run, tmp_path)
    other_model = shutil.copytree(tiny_model_dir, tmp_path / "other-model")
    allow = "output.allow_changes=[algorithm.group_size,model.name]"
    changed = ["algorithm.group_size=2", f"model.name={other_model}"]
    assert main(["train", recipe, "output.resume=true", "train.steps=6", *changed, allow]) == 0
    out = capsys.readouterr().out
    assert (
        f"polo: resuming from step-000004 with model.name {str(tiny_model_dir)!r} -> {str(other_model)!r}, "
        f"algorithm.group_size 4 -> 2, as output.allow_changes allows (recorded in {CHANGES_FILE})"
    ) in out
    assert training_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    rows = [json.loads(line) for line in (run_dir / CHANGES_FILE).read_text().splitlines()]
    assert [(row["step"], row["key"], row["was"], row["now"]) for row in rows] == [
        (4, "model.name", str(tiny_model_dir), str(other_model)),
        (4, "algorithm.group_size", 4, 2),
    ]
    # config.yaml: the values the run started with, and a comment line for each change
    text = (run_dir / "config.yaml").read_text()
    assert yaml.safe_load(text)["algorithm"]["group_size"] == 4
    assert yaml.safe_load(text)["model"]["name"] == str(tiny_model_dir)
    assert f"# after step 4 the run went on with algorithm.group_size: 2 (was 4; {CHANGES_FILE})" in text
    # the checkpoint holds the recipe it was trained under; the model card names the model the run started from
    final = run_dir / "checkpoints" / "step-000006"
    assert yaml.safe_load((final / "config.yaml").read_text())["algorithm"]["group_size"] == 2
    card = (final / "README.md").read_text()
    assert f"fine-tune of `{tiny_model_dir}`" in card and "# after step 4 the run went on with model.name" in card

    # the next resume compares with the checkpoint's recipe: the changed values go on without a new allowance
    assert main(["train", recipe, "output.resume=true", "train.steps=7", *changed]) == 0
    assert training_steps(run_dir) == [1, 2, 3, 4, 5, 6, 7]
    assert len((run_dir / CHANGES_FILE).read_text().splitlines()) == 2
    capsys.readouterr()
    # and going back to the starting value is a change like any other
    assert main(["train", recipe, "output.resume=true", "train.steps=8", f"model.name={other_model}"]) == 2
    assert "(algorithm.group_size was 2 in the run, 4 here)" in one_error_line(capsys)


# ------------------------------------------------------------------ a damaged newest checkpoint


def damage(checkpoint: Path, how: str) -> str:
    """Damage `checkpoint` as `how` says; return the start of the problem polo should name."""
    if how == "missing trainer_state.pt":
        (checkpoint / "trainer_state.pt").unlink()
        return "trainer_state.pt is missing"
    path = checkpoint / ("trainer_state.pt" if how == "truncated trainer_state.pt" else "model.safetensors")
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    if path.name == "model.safetensors":
        return f"model.safetensors is truncated ({size // 2:,} of {size:,} bytes)"
    return "trainer_state.pt cannot be read (RuntimeError: "


@pytest.mark.parametrize(
    "how", ["truncated trainer_state.pt", "truncated model.safetensors", "missing trainer_state.pt"]
)
def test_a_damaged_newest_checkpoint_is_named_and_the_run_goes_on_from_the_intact_one(
    finished_run, tmp_path, capsys, how
):
    run_dir, recipe = copy_run(finished_run, tmp_path)
    checkpoints = run_dir / "checkpoints"
    weights = load_file(str(checkpoints / "step-000004" / "model.safetensors"))
    uninterrupted = {name: tensor.clone() for name, tensor in weights.items()}  # not a view of the file damaged next
    problem = damage(checkpoints / "step-000004", how)
    assert main(["train", recipe, "output.resume=true"]) == 0
    out = capsys.readouterr().out
    warning = f"polo: warning: checkpoint {checkpoints / 'step-000004'} is damaged ({problem}"
    assert [line for line in out.splitlines() if "damaged" in line] == [
        next(line for line in out.splitlines() if line.startswith(warning))
    ]
    assert (
        out.split(warning)[1].split("\n")[0].endswith("; set aside as damaged-step-000004, resuming from step-000002")
    )
    assert (checkpoints / "damaged-step-000004").is_dir()
    # steps 3 and 4 again, from step 2's exact state: the same weights as the run before the damage
    assert training_steps(run_dir) == [1, 2, 3, 4]
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in row] == [4]
    again = load_file(str(checkpoints / "step-000004" / "model.safetensors"))
    assert all(torch.equal(again[name], uninterrupted[name]) for name in uninterrupted)


def test_when_every_checkpoint_is_damaged_each_is_named_and_the_resume_is_refused(finished_run, tmp_path, capsys):
    run_dir, recipe = copy_run(finished_run, tmp_path)
    checkpoints = run_dir / "checkpoints"
    damage(checkpoints / "step-000004", "truncated model.safetensors")
    damage(checkpoints / "step-000002", "missing trainer_state.pt")
    assert main(["train", recipe, "output.resume=true"]) == 2
    captured = capsys.readouterr()
    warnings = [line for line in captured.out.splitlines() if "damaged" in line]
    assert len(warnings) == 2
    assert warnings[0].endswith("set aside as damaged-step-000004, no intact checkpoint is left")
    assert "step-000002 is damaged (trainer_state.pt is missing)" in warnings[1]
    assert captured.err.startswith(
        f"polo: error: output.resume=true but output.dir {run_dir} has no complete checkpoint"
    )


# ------------------------------------------------------------------ a finished run, steps=0


def test_resuming_a_finished_run_says_it_is_finished_and_changes_nothing(finished_run, tmp_path, monkeypatch, capsys):
    run_dir, recipe = copy_run(finished_run, tmp_path)
    before = snapshot(run_dir)
    no_model_load(monkeypatch)
    assert main(["train", recipe, "output.resume=true"]) == 0
    out = capsys.readouterr().out
    assert (
        f"polo: output.dir {run_dir} holds a finished run (step-000004, train.steps=4): nothing to resume; "
        "raise train.steps to train on, or start again with output.overwrite=true"
    ) in out
    assert snapshot(run_dir) == before  # no second evaluation row, no new checkpoint or model card
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in row] == [4]
    assert main(["train", recipe, "output.resume=true", "train.steps=2"]) == 0  # past the end: finished as well
    assert "holds a finished run (step-000004, train.steps=2): nothing to resume" in capsys.readouterr().out
    assert snapshot(run_dir) == before


def test_train_steps_0_does_nothing_and_says_so(tiny_model_dir, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_config(tiny_model_dir, run_dir)))
    no_model_load(monkeypatch)
    assert main(["train", str(recipe), "train.steps=0"]) == 0
    assert capsys.readouterr().out == (
        f"polo: train.steps=0: nothing to train; nothing was loaded, and {run_dir} is untouched\n"
    )
    assert not run_dir.exists()


# ------------------------------------------------------------------ a run that never finished a step


def test_a_run_that_failed_before_its_first_step_does_not_block_the_fixed_rerun(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    (tmp_path / "my_rewards.py").write_text("def broken(completion, row):\n    raise ValueError('not yet written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    config = tiny_config(tiny_model_dir, run_dir, output={"plots": False}, train={"steps": 2})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**config, "rewards": {"my_rewards:broken": 1.0}}))
    assert main(["train", str(recipe)]) == 2  # the reward fails in step 1, after the step-0 evaluation
    assert "polo: error: reward function 'broken' failed on sample" in capsys.readouterr().err
    left = sorted(path.name for path in run_dir.iterdir() if path.name != ".polo.lock")
    assert left == ["config.yaml", "eval_step000000.json", "metrics.jsonl", "tensorboard"]

    recipe.write_text(yaml.safe_dump(config))  # the fix
    assert main(["train", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert f"polo: output.dir {run_dir} held only a run that never finished a step (" in out
    assert training_steps(run_dir) == [1, 2]
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in row] == [0, 2]


# ------------------------------------------------------------------ an output directory that cannot be written


def unshare_works() -> bool:
    """Return whether this machine lets a process bind-mount a folder read-only in its own mount namespace."""
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        mount = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && ! touch {folder}/x"
        probe = subprocess.run(["unshare", "-rm", "sh", "-c", mount], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not unshare_works(), reason="unshare -rm cannot make a read-only bind mount here")
@pytest.mark.parametrize("inside", ["run", "runs/new/run"])
def test_an_output_dir_on_a_read_only_file_system_is_one_line(tiny_model_dir, tmp_path, inside):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    run_dir = read_only / inside
    if inside == "run":
        run_dir.mkdir()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_config(tiny_model_dir, run_dir)))
    mount = f"mount --bind {read_only} {read_only} && mount -o remount,bind,ro {read_only}"
    child = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$0" train "$1"', str(POLO), str(recipe)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 2 and child.stdout == "", child
    missing = "" if inside == "run" else f": {read_only / 'runs'}"
    assert child.stderr == (
        f"polo: error: output.dir {run_dir} cannot be written (Read-only file system{missing}): "
        "pick another output.dir\n"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder whatever its mode bits")
def test_an_output_dir_under_a_folder_this_user_cannot_write_is_one_line(tiny_model_dir, tmp_path, capsys):
    parent = tmp_path / "not-mine"
    parent.mkdir()
    parent.chmod(0o555)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_config(tiny_model_dir, parent / "run")))
    try:
        assert main(["train", str(recipe)]) == 2
    finally:
        parent.chmod(0o755)
    assert one_error_line(capsys) == (
        f"polo: error: output.dir {parent / 'run'} cannot be written (Permission denied): pick another output.dir"
    )
