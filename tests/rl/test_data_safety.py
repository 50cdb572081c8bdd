"""No silent data loss: an earlier run is never overwritten unasked, the newest checkpoint is never
rotated away, and a step that wrecks the weights stops the run before they are saved."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_trainer import tiny_config

from polo.cli import main
from polo.config import ConfigError, load_config
from polo.models.loading import load_policy
from polo.rl import setup as rl_setup
from polo.rl import step as rl_step_module
from polo.rl import train as trainer
from polo.rl.guard import DivergenceGuard
from polo.rl.train import train
from polo.runtime.checkpoint import Checkpointer, OutputDirInUseError
from polo.runtime.errors import DivergenceError, NonFiniteLossError
from polo.runtime.metrics import read_metrics

QUICK = {"eval": {"before": False, "after": False}}


def snapshot(directory):
    """Every file under `directory` with its bytes' digest: what 'nothing lost' compares."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def cli_train(config: dict, tmp_path, *overrides: str) -> int:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    return main(["train", str(recipe), *overrides])


def no_model_load(monkeypatch):
    """Make loading the policy fail loudly, so a test proves its refusal came first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(rl_setup, "load_models", refuse)


# ------------------------------------------------------------------ an earlier run in output.dir


@pytest.fixture
def first_run(tiny_model_dir, tmp_path):
    """A finished 4-step run (checkpoints, metrics, samples, TensorBoard) and the digest of every file it left."""
    config = tiny_config(tiny_model_dir, tmp_path / "run", eval={"before": False})
    train(config)
    return config, snapshot(tmp_path / "run")


def test_a_second_run_into_the_same_dir_stops_with_one_line_and_the_first_is_intact(
    first_run, tmp_path, monkeypatch, capsys
):
    config, before = first_run
    assert {"metrics.jsonl", "samples.jsonl", "config.yaml", "checkpoints/step-000004/model.safetensors"} <= set(before)
    assert any(name.startswith("tensorboard/") for name in before)
    no_model_load(monkeypatch)
    assert cli_train(config, tmp_path, "train.seed=7") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"polo: error: output.dir {tmp_path / 'run'} already holds a run "
        "(checkpoints/, tensorboard/, metrics.jsonl, samples.jsonl, ...): "
        "continue it with output.resume=true, or replace it with output.overwrite=true, or pick a new output.dir"
    )
    assert snapshot(tmp_path / "run") == before


def test_resume_without_a_checkpoint_over_an_earlier_run_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    train(
        tiny_config(tiny_model_dir, tmp_path / "run", output={"save_every": 0, "keep_checkpoints": 1}, **QUICK),
        ["train.steps=1"],
    )
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # as if the run had died before its first checkpoint
    before = snapshot(tmp_path / "run")
    no_model_load(monkeypatch)
    with pytest.raises(
        OutputDirInUseError,
        match=r"output.resume=true but output.dir .* has no complete checkpoint, "
        r"only an earlier run's files \(tensorboard/, metrics.jsonl",
    ):
        train(tiny_config(tiny_model_dir, tmp_path / "run", **QUICK), ["output.resume=true"])
    with pytest.raises(
        OutputDirInUseError
    ) as error:  # nothing to resume: the only ways on are a clean start or a new dir
        train(tiny_config(tiny_model_dir, tmp_path / "run", **QUICK))
    assert str(error.value).endswith(
        "already holds a run (tensorboard/, metrics.jsonl, samples.jsonl, config.yaml, ...): "
        "replace it with output.overwrite=true, or pick a new output.dir"
    )
    assert snapshot(tmp_path / "run") == before


def test_overwrite_removes_the_earlier_run_says_so_and_keeps_the_users_own_files(first_run, tmp_path, capsys):
    config, _ = first_run
    notes = tmp_path / "run" / "notes.txt"
    notes.write_text("mine")
    result = train(config, ["output.overwrite=true", "train.steps=2"])
    out = capsys.readouterr().out
    assert (
        f"polo: output.overwrite=true: removed the earlier run in {tmp_path / 'run'} "
        "(checkpoints/, tensorboard/, metrics.jsonl, samples.jsonl, ...)" in out
    )
    assert [row["step"] for row in result.metrics if "loss" in row] == [1, 2]
    assert sorted(path.name for path in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000002"]
    assert notes.read_text() == "mine"


def test_resume_still_continues_an_earlier_run(first_run, tmp_path):
    config, _ = first_run
    result = train(config, ["output.resume=true", "train.steps=6"])
    assert [row["step"] for row in result.metrics if "loss" in row] == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------ checkpoint rotation


@pytest.mark.parametrize("keep", [0, -3, 1])
def test_rotation_never_deletes_the_newest_checkpoint_whatever_keep_says(tiny_model_dir, tmp_path, keep):
    model, tokenizer = load_policy(str(tiny_model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    checkpointer = Checkpointer(tmp_path, keep)
    for step in (1, 2, 3):
        saved = checkpointer.save(step, model, tokenizer, optimizer, scheduler, {})
        assert saved.exists() and checkpointer.latest() == saved
    assert [path.name for path in checkpointer.root.iterdir()] == ["step-000003"]
    assert load_file(str(checkpointer.latest() / "model.safetensors"))


# ------------------------------------------------------------------ the divergence guard


def test_a_huge_learning_rate_stops_at_step_1_before_the_ruined_weights_are_saved(tiny_model_dir, tmp_path, capsys):
    start = snapshot(tiny_model_dir)
    overrides = ("train.learning_rate=1", "train.on_divergence=stop")  # the top of its range
    assert cli_train(tiny_config(tiny_model_dir, tmp_path / "run", **QUICK), tmp_path, *overrides) == 2
    err = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("polo")
    ]  # not transformers' progress bars
    assert len(err) == 1 and err[0].startswith("polo: error: step 1 diverged: weight_norm ")
    assert "x the starting weights' " in err[0] and "(train.divergence_factor=10)" in err[0]
    assert err[0].endswith(
        "the run stopped without saving it; no checkpoint was written before step 1 and the starting model "
        f"{tiny_model_dir} is untouched: start again with a lower train.learning_rate and output.overwrite=true"
    )
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))
    assert snapshot(tiny_model_dir) == start
    rows = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and '"step": 1' in rows[0]  # the diverged step is on record, and nothing after it


def jump_at(step_to_break: int, monkeypatch):
    """Make step `step_to_break` take one optimizer step at learning rate 1e9 (its loss and gradient stay finite)."""
    real_step = trainer.rl_step

    def step_with_a_huge_rate(run, step):
        if step == step_to_break:
            for group in run.optimizer.param_groups:
                group["lr"] = 1e9
        return real_step(run, step)

    monkeypatch.setattr(trainer, "rl_step", step_with_a_huge_rate)
    return real_step


def test_a_jump_after_a_checkpoint_names_that_checkpoint_and_resuming_from_it_goes_on(
    tiny_model_dir, tmp_path, monkeypatch
):
    config = tiny_config(tiny_model_dir, tmp_path / "run", train={"on_divergence": "stop"}, **QUICK)
    real_step = jump_at(3, monkeypatch)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    with pytest.raises(DivergenceError) as error:
        train(config)
    message = str(error.value)
    assert message.startswith("step 3 diverged: weight_norm ") and "x step 2's " in message
    assert message.endswith(
        f"its last checkpoint, written before the jump, is {checkpoint}: continue from it with output.resume=true "
        "and a lower train.learning_rate"
    )
    assert sorted(path.name for path in checkpoint.parent.iterdir()) == ["step-000002"]
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert max(float(tensor.abs().max()) for tensor in weights.values()) < 100  # good weights, not the 1e9 ones

    monkeypatch.setattr(trainer, "rl_step", real_step)
    resumed = train(config, ["output.resume=true"])
    assert [row["step"] for row in resumed.metrics if "loss" in row] == [1, 2, 3, 4]
    assert all(row["weight_norm"] < 100 for row in resumed.metrics if "weight_norm" in row)


def jump_once_at(step_to_break: int, monkeypatch) -> list[list[str]]:
    """Return the data position each step drew, filled as the run goes; the first time step `step_to_break` runs,
    it takes a 1e9 learning-rate step."""
    real_step, broken, positions = trainer.rl_step, [], []
    real_batch_rows = rl_step_module.batch_rows

    def record(rows, position, *args, **kwargs):
        positions.append(position)
        return real_batch_rows(rows, position, *args, **kwargs)

    def step_with_a_huge_rate(run, step):
        if step == step_to_break and not broken:
            broken.append(step)
            for group in run.optimizer.param_groups:
                group["lr"] = 1e9
        return real_step(run, step)

    monkeypatch.setattr(trainer, "rl_step", step_with_a_huge_rate)
    monkeypatch.setattr(rl_step_module, "batch_rows", record)
    return positions


@pytest.mark.parametrize("lora", [False, True])
def test_a_jump_rolls_back_to_the_checkpoint_before_it_skips_its_batch_and_finishes(
    tiny_model_dir, tmp_path, monkeypatch, capsys, lora
):
    settings = {"lora": {"r": 4, "alpha": 8}} if lora else {}
    config = tiny_config(tiny_model_dir, tmp_path / "run", model={"name": str(tiny_model_dir), **settings}, **QUICK)
    positions = jump_once_at(3, monkeypatch)
    result = train(config)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    out = capsys.readouterr().out
    assert (
        "diverged: weight_norm " in out
        and f"rolling back to {checkpoint} and skipping the 1 batch(es) drawn since (rollback 1 of at most 3" in out
    )
    assert [row["step"] for row in result.metrics if "loss" in row] == [
        1,
        2,
        3,
        4,
    ]  # the diverged attempt's row is gone
    assert [row.get("rollbacks", 0) for row in result.metrics if "loss" in row] == [0, 0, 1, 1]
    assert all(row["weight_norm"] < 100 for row in result.metrics if "weight_norm" in row)
    # steps 1, 2, 3 (diverged) drew positions 0, 1, 2; after the rollback steps 3 and 4 draw 3 and 4: batch 2 is skipped
    assert positions == [0, 1, 2, 3, 4]
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    assert (state["data_offset"], state["rollbacks"]) == (1, 1)  # a resume from here keeps skipping what was skipped


def poison_weights_from(step_to_break: int, monkeypatch) -> None:
    """Make every update of step `step_to_break` or later leave an infinite weight behind."""
    real_update, steps = rl_step_module.policy_update, []
    real_step = trainer.rl_step

    def note_step(run, step):
        steps.append(step)
        return real_step(run, step)

    def update_then_poison(learner, *args, **kwargs):
        metrics = real_update(learner, *args, **kwargs)
        if steps[-1] >= step_to_break:
            with torch.no_grad():
                next(learner.model.parameters()).view(-1)[0] = float("inf")
        return metrics

    monkeypatch.setattr(trainer, "rl_step", note_step)
    monkeypatch.setattr(rl_step_module, "policy_update", update_then_poison)


def test_rollbacks_that_do_not_help_stop_the_run_naming_the_checkpoint_before_the_jump(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    poison_weights_from(3, monkeypatch)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    with pytest.raises(DivergenceError) as error:
        train(tiny_config(tiny_model_dir, tmp_path / "run", train={"max_rollbacks": 2}, **QUICK))
    rollbacks = [line for line in capsys.readouterr().out.splitlines() if "rolling back" in line]
    assert [line.split(" diverged")[0] for line in rollbacks] == ["polo: warning: step 3"] * 2
    assert f"rolling back to {checkpoint} and skipping the 1 batch(es)" in rollbacks[0]
    assert (
        f"rolling back to {checkpoint} and skipping the 1 batch(es)" in rollbacks[1]
    )  # each retry skips the next batch too
    assert str(error.value) == (
        "step 3 diverged: weight_norm is inf; 2 rollbacks did not help (train.max_rollbacks=2); the run stopped "
        f"without saving it; its last checkpoint, written before the jump, is {checkpoint}: continue from it with "
        "output.resume=true and a lower train.learning_rate"
    )
    assert sorted(path.name for path in checkpoint.parent.iterdir()) == ["step-000002"]
    assert [row["step"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in row] == [
        1,
        2,
        3,
    ]  # the last attempt's step 3 is on record


def test_non_finite_weights_stop_the_run_even_with_jump_checks_off(tiny_model_dir, tmp_path, monkeypatch):
    real_update = rl_step_module.policy_update

    def update_then_poison(learner, *args, **kwargs):
        metrics = real_update(learner, *args, **kwargs)
        with torch.no_grad():
            next(learner.model.parameters()).view(-1)[0] = float("inf")
        return metrics

    monkeypatch.setattr(rl_step_module, "policy_update", update_then_poison)
    with pytest.raises(
        DivergenceError, match=r"^step 1 diverged: weight_norm is inf; .*no checkpoint was written before step 1"
    ):
        train(
            tiny_config(
                tiny_model_dir, tmp_path / "run", train={"divergence_factor": 0, "on_divergence": "stop"}, **QUICK
            )
        )


def test_consecutive_nan_steps_before_any_checkpoint_name_the_untouched_starting_model(
    tiny_model_dir, tmp_path, monkeypatch
):
    def always_nan(*args, **kwargs):
        raise NonFiniteLossError("loss is nan (injected)")

    monkeypatch.setattr(rl_step_module, "policy_update", always_nan)
    with pytest.raises(
        NonFiniteLossError, match=f"no checkpoint was written yet and the starting model {tiny_model_dir} is untouched"
    ):
        train(tiny_config(tiny_model_dir, tmp_path / "run", train={"max_nonfinite_steps": 1}, **QUICK))


def guard_over(settings: dict) -> DivergenceGuard:
    return DivergenceGuard(
        torch.nn.Linear(2, 2), load_config({"train": settings}), Checkpointer(Path("/nonexistent"), 2)
    )


def test_loss_and_gradient_norm_jumps_are_judged_only_when_asked_for():
    default = guard_over({})
    asked = guard_over({"divergence_checks": ["weight_norm", "grad_norm", "loss"], "divergence_factor": 5})
    for step in (1, 2, 3):
        for guard in (default, asked):
            assert guard.judge(step, {"loss": 0.1 * step, "grad_norm": 1.0}) is None
    assert default.judge(4, {"loss": 0.2, "grad_norm": 40.0}) is None
    reason = asked.judge(4, {"loss": 0.2, "grad_norm": 40.0})
    assert reason.startswith(
        "step 4 diverged: grad_norm 40 is 40x the median of 3 accepted steps' 1 (train.divergence_factor=5)"
    )
    assert asked.judge(4, {"loss": -3.0, "grad_norm": 1.0}).startswith("step 4 diverged: loss 3 is 15x the median")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.divergence_factor=0.5", "train.divergence_factor must be 0 .* or a finite number above 1, got 0.5"),
        (
            "train.divergence_checks=[weight_norm,gradnorm]",
            "train.divergence_checks: unknown check 'gradnorm'; choose from weight_norm, grad_norm, loss",
        ),
        ("train.on_divergence=retry", "train.on_divergence"),
        ("train.max_rollbacks=-1", "train.max_rollbacks"),
    ],
)
def test_guard_settings_that_make_no_sense_stop_before_the_model_loads(
    tiny_model_dir, tmp_path, monkeypatch, override, match
):
    no_model_load(monkeypatch)
    with pytest.raises(ConfigError, match=match):
        train(tiny_config(tiny_model_dir, tmp_path / "run", **QUICK), [override])
