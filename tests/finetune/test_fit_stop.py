"""polo sft, rm and dpo stop at SIGTERM after the step in progress, and say how to start again (they keep no
checkpoint)."""

from __future__ import annotations

import signal

import yaml
from test_sft import tiny_recipe

from polo.cli import main
from polo.finetune import fit as fit_module
from polo.runtime.interrupt import EXIT_STOPPED
from polo.runtime.metrics import read_metrics
from polo.runtime.run_lock import LOCK_FILE


def test_sigterm_during_an_sft_step_finishes_it_then_stops_with_the_command_to_start_again(
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
    assert (
        "polo: SIGTERM: stopping after this step (polo sft, rm and dpo keep no checkpoint: the run starts again)"
        in captured.out
    )
    assert captured.err.strip().splitlines()[-1] == (
        "polo: stopped by SIGTERM after step 2; polo sft cannot resume; start it again with: "
        f"polo sft {path} train.seed=1 output.overwrite=true"
    )
    assert [row["step"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in row] == [1, 2]
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / LOCK_FILE).exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
