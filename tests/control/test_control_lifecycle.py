"""`polo control` runs through the run lifecycle: a callback stops it, a recipe names one, SIGTERM stops it cleanly."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import yaml

from polo.cli import main
from polo.control import train
from polo.control import trainer as trainer_module
from polo.runtime.callbacks import Callback
from polo.runtime.interrupt import EXIT_STOPPED
from polo.runtime.metrics import read_metrics

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FAST = ["train.rollout_steps=16", "output.progress=false", "output.report_to=[]", "train.total_steps=2000"]


class StopAtUpdate(Callback):
    def __init__(self, update: int = 3):
        self.update, self.steps = update, []

    def on_step_end(self, step, metrics):
        self.steps.append(step)
        return "enough updates" if step == self.update else None


def test_a_python_callback_stops_a_control_run_after_its_third_update(tmp_path, capsys):
    stopper = StopAtUpdate(3)
    result = train(RECIPES / "a2c_cartpole.yaml", [*FAST, f"output.dir={tmp_path}"], callbacks=[stopper])
    assert (result.updates, stopper.steps) == (3, [1, 2, 3])
    assert [row["update"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert "polo: stopping after step 3: enough updates" in capsys.readouterr().out


def test_a_recipe_callback_stops_a_control_run_that_writes_nothing(tmp_path, monkeypatch):
    (tmp_path / "control_callbacks.py").write_text(
        "from polo.runtime.callbacks import Callback\n\n"
        "class StopAt(Callback):\n"
        "    def __init__(self, update):\n"
        "        self.update = update\n\n"
        "    def on_step_end(self, step, metrics):\n"
        "        return 'stop' if step == self.update else None\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    callbacks = "output.callbacks=[{name: 'control_callbacks:StopAt', options: {update: 2}}]"
    result = train(RECIPES / "a2c_cartpole.yaml", [*FAST, callbacks], write_files=False)
    assert result.updates == 2 and result.output_dir is None


def test_sigterm_stops_polo_control_after_the_update_with_the_command_to_start_again(tmp_path, monkeypatch, capsys):
    recipe = yaml.safe_load((RECIPES / "a2c_cartpole.yaml").read_text())
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump(recipe))
    real_build_batch = trainer_module.build_batch
    calls = []

    def signalling(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # in update 2
            signal.raise_signal(signal.SIGTERM)
        return real_build_batch(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "build_batch", signalling)
    assert main(["control", str(path), *FAST, f"output.dir={tmp_path / 'run'}"]) == EXIT_STOPPED
    words = shlex.join([str(path), *FAST, f"output.dir={tmp_path / 'run'}"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"polo: stopped by SIGTERM after step 2; polo control cannot resume; start it again with: "
        f"polo control {words} output.overwrite=true"
    )
    assert [row["update"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
