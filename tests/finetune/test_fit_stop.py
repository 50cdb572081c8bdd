"""polo sft, rm and dpo stop at SIGTERM after the step in progress, save it, and say how to continue."""

from __future__ import annotations

import signal

import yaml
from test_sft import tiny_recipe

from polo.cli import main
from polo.finetune import fit as fit_module
from polo.runtime.interrupt import EXIT_STOPPED
from polo.runtime.metrics import read_metrics
from polo.runtime.run_lock import LOCK_FILE


def test_sigterm_during_an_sft_step_finishes_and_saves_it_then_stops_with_the_command_to_resume(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tiny_model_dir, tmp_path, train={"max_steps": 4})))
    real_backpropagate = fit_module._backpropagate

    def signalling(*args, **kwargs):
        if args[-1] == 2:  # in step 2
            signal.raise_signal(signal.SIGTERM)
        return real_backpropagate(*args, **kwargs)

    monkeypatch.setattr(fit_module, "_backpropagate", signalling)
    assert main(["sft", str(path), "train.seed=1"]) == EXIT_STOPPED
    captured = capsys.readouterr()
    assert "polo: SIGTERM: stopping after this step and saving a checkpoint (send SIGTERM again to abort now)" in (
        captured.out
    )
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    assert captured.err.strip().splitlines()[-1] == (
        f"polo: stopped by SIGTERM after step 2; saved {checkpoint}; resume with: "
        f"polo sft {path} train.seed=1 output.resume=true"
    )
    assert [row["step"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in row] == [1, 2]
    assert (checkpoint / "trainer_state.pt").exists() and (checkpoint / "model.safetensors").exists()
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / LOCK_FILE).exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def signal_in_evaluation(monkeypatch, which: int) -> list[str]:
    """Make the `which`-th held-out evaluation of an SFT run send SIGTERM (and never finish); return what it did."""
    from polo.finetune.sft import SFTTrainer

    real, seen = SFTTrainer.held_out_metrics, []

    def evaluating(self):
        seen.append("evaluated")
        if len(seen) == which:
            signal.raise_signal(signal.SIGTERM)
            seen.append("finished after the signal")  # never: the signal abandons the evaluation at once
        return real(self)

    monkeypatch.setattr(SFTTrainer, "held_out_metrics", evaluating)
    return seen


def test_sigterm_in_the_evaluation_before_the_first_step_stops_at_once_with_nothing_saved(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tiny_model_dir, tmp_path, train={"max_steps": 4})))
    seen = signal_in_evaluation(monkeypatch, 1)
    assert main(["sft", str(path)]) == EXIT_STOPPED
    captured = capsys.readouterr()
    assert "polo: SIGTERM: stopping now: the held-out evaluation at step 0 is abandoned" in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        "polo: stopped by SIGTERM before the first step; no checkpoint was written yet; start it again with: "
        f"polo sft {path} output.overwrite=true"
    )
    assert seen == ["evaluated"] and not (tmp_path / "run" / "checkpoints").exists()


def test_sigterm_in_the_final_evaluation_stops_at_once_saving_the_steps_since_the_last_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tiny_model_dir, tmp_path, train={"max_steps": 3})))
    seen = signal_in_evaluation(monkeypatch, 2)  # the one before training, then the final one
    assert main(["sft", str(path)]) == EXIT_STOPPED
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000003"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"polo: stopped by SIGTERM after step 3; saved {checkpoint}; resume with: polo sft {path} output.resume=true"
    )
    assert seen == ["evaluated", "evaluated"] and (checkpoint / "trainer_state.pt").exists()
    monkeypatch.undo()
    assert main(["sft", str(path), "output.resume=true"]) == 0  # only the final evaluation is left to do
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3]
    assert [row["step"] for row in rows if "eval/loss" in row] == [0, 3]
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
