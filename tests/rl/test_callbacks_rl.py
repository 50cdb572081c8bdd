"""A callback stops a `polo train` run early: a Python object given to `polo.train`, and EarlyStopping named in a
recipe run by the `polo` command line."""

from __future__ import annotations

import yaml

import polo
from conftest import tiny_rl_config
from polo.cli import main
from polo.runtime.callbacks import Callback
from polo.runtime.metrics import read_metrics


class StopAfter(Callback):
    """Records every hook it sees and asks the run to stop after step `last`."""

    def __init__(self, last: int):
        self.last, self.calls = last, []

    def on_run_start(self, run):
        self.calls.append(("start", run.name, run.start_step, run.total_steps))

    def on_step_end(self, step, metrics):
        self.calls.append(("step", step, "reward/mean" in metrics))
        return f"enough after step {step}" if step == self.last else None

    def on_evaluate(self, step, metrics):
        self.calls.append(("evaluate", step, "eval/accuracy" in metrics))

    def on_checkpoint(self, step, path):
        self.calls.append(("checkpoint", step, path.name))

    def on_run_end(self, result):
        self.calls.append(("end", result.steps))


def test_a_python_callback_sees_each_point_of_the_run_and_stops_it_after_step_2(tiny_model_dir, tmp_path, capsys):
    stopper = StopAfter(2)
    config = tiny_rl_config(tiny_model_dir, tmp_path / "run", output={"save_every": 0})
    result = polo.train(config, callbacks=[stopper])
    assert stopper.calls == [
        ("start", "polo train", 0, 4),
        ("evaluate", 0, True),
        ("step", 1, True),
        ("step", 2, True),
        ("evaluate", 2, True),  # the final evaluation, at the step the run stopped after
        ("checkpoint", 2, "step-000002"),  # the final model
        ("end", 2),
    ]
    assert result.steps == 2 and result.eval_after is not None
    assert [row["step"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in row] == [1, 2]
    assert "polo: stopping after step 2: enough after step 2" in capsys.readouterr().out


def test_early_stopping_from_a_recipe_stops_polo_train_at_the_first_evaluation_without_improvement(
    tiny_model_dir, tmp_path, capsys
):
    # No accuracy can rise by more than 2: the first evaluation after the one before training ends the run.
    early = {"name": "EarlyStopping", "options": {"metric": "accuracy", "patience": 1, "min_delta": 2, "mode": "max"}}
    config = tiny_rl_config(tiny_model_dir, tmp_path / "run", eval={"every": 1}, output={"callbacks": [early]})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    assert "polo: stopping after step 1: early stopping: accuracy" in out
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows if "reward/mean" in row] == [1]
    assert [row["step"] for row in rows if "eval/accuracy" in row] == [0, 1]  # the stop's evaluation is the final one
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / "README.md").exists()
