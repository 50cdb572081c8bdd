"""polo train stops at once at a signal during a held-out evaluation: before the first step nothing is saved."""

from __future__ import annotations

import signal

import yaml

from conftest import tiny_rl_config
from polo.cli import main
from polo.rl.train import HeldOutEvaluation
from polo.runtime.interrupt import EXIT_STOPPED


def test_sigterm_in_polo_train_s_evaluation_before_the_first_step_stops_at_once_with_nothing_saved(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_rl_config(tiny_model_dir, run_dir, output={"plots": False})))
    real, seen = HeldOutEvaluation.__call__, []

    def evaluating(self, step):
        seen.append(step)
        signal.raise_signal(signal.SIGTERM)
        seen.append("finished after the signal")  # never: the signal abandons the evaluation at once
        return real(self, step)

    monkeypatch.setattr(HeldOutEvaluation, "__call__", evaluating)
    assert main(["train", str(recipe)]) == EXIT_STOPPED
    captured = capsys.readouterr()
    assert "polo: SIGTERM: stopping now: the held-out evaluation at step 0 is abandoned" in captured.out
    assert "stopped by SIGTERM before the first step; no checkpoint was written yet" in captured.err
    assert seen == [0] and not (run_dir / "checkpoints").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
