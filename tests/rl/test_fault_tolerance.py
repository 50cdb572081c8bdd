"""Faults a long run must survive: SIGKILL between checkpoints, NaN losses, reward functions that raise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_trainer import final_weights, tiny_config, without_times

from polo.rl import step as rl_step_module
from polo.rl.train import train
from polo.runtime import checkpoint as checkpoint_module
from polo.runtime.checkpoint import SaveError
from polo.runtime.errors import NonFiniteLossError
from polo.runtime.metrics import read_metrics

CHILD = "import json, sys, polo; polo.train(json.loads(sys.argv[1]))"


def test_sigkill_between_checkpoints_then_resume_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    steps = {"steps": 6}
    straight = train(tiny_config(tiny_model_dir, tmp_path / "straight", train=steps, eval={"before": False}))

    config = tiny_config(tiny_model_dir, tmp_path / "killed", train=steps, eval={"before": False})
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    first_checkpoint = tmp_path / "killed" / "checkpoints" / "step-000002" / "trainer_state.pt"
    deadline = time.time() + 600  # generous: CI machines can be busy
    while not first_checkpoint.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert first_checkpoint.exists(), "the child never wrote its first checkpoint"
    os.kill(child.pid, signal.SIGKILL)  # somewhere in step 3 or 4: no chance to clean up
    child.wait()
    assert child.returncode == -signal.SIGKILL
    killed_rows = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert killed_rows and max(row["step"] for row in killed_rows) < 6

    resumed = train(config, ["output.resume=true"])
    assert without_times(resumed.metrics) == without_times(straight.metrics)
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_partial_last_metrics_line_is_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)


def test_a_nan_step_is_skipped_and_the_run_goes_on(tiny_model_dir, tmp_path, monkeypatch, capsys):
    real_update, calls = rl_step_module.policy_update, []

    def nan_on_second_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise NonFiniteLossError("loss is nan (injected)")
        return real_update(*args, **kwargs)

    monkeypatch.setattr(rl_step_module, "policy_update", nan_on_second_call)
    result = train(tiny_config(tiny_model_dir, tmp_path / "run", eval={"before": False, "after": False}))
    rows = [row for row in result.metrics if "step" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[1].get("skipped_nonfinite") == 1.0 and "loss" not in rows[1]
    assert all("loss" in rows[i] for i in (0, 2, 3))
    assert "step 2 skipped: loss is nan (injected)" in capsys.readouterr().out


def test_consecutive_nan_steps_stop_the_run_and_keep_the_last_good_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    real_update, calls = rl_step_module.policy_update, []

    def nan_from_third_call(*args, **kwargs):
        calls.append(1)
        if len(calls) >= 3:
            raise NonFiniteLossError("loss is inf (injected)")
        return real_update(*args, **kwargs)

    monkeypatch.setattr(rl_step_module, "policy_update", nan_from_third_call)
    config = tiny_config(
        tiny_model_dir, tmp_path / "run", train={"steps": 8, "max_nonfinite_steps": 2}, eval={"before": False}
    )
    with pytest.raises(
        NonFiniteLossError, match=r"2 steps in a row had a non-finite loss, stopping at step 4 .*step-000002"
    ):
        train(config)
    assert [path.name for path in (tmp_path / "run" / "checkpoints").glob("step-*")] == ["step-000002"]


def test_a_raising_reward_can_score_zero_and_be_counted(tiny_model_dir, tmp_path, capsys):
    def flaky(completion: str, row: dict) -> float:
        if row["operands"][0] % 2:
            raise ValueError("cannot score odd operands")
        return 1.0

    result = train(
        tiny_config(tiny_model_dir, tmp_path / "run", eval={"before": False, "after": False}),
        ["train.on_reward_error=zero"],
        reward_functions={flaky: 1.0},
    )
    rows = [row for row in result.metrics if "reward/flaky/errors" in row]
    assert len(rows) == 4 and sum(row["reward/flaky/errors"] for row in rows) > 0
    assert all(row["reward/correct/errors"] == 0 for row in rows)
    assert all(row["reward/errors"] == row["reward/flaky/errors"] for row in rows)
    assert "scored 0: reward function 'flaky' failed on sample" in capsys.readouterr().out


def test_a_crash_while_saving_leaves_the_previous_checkpoint_as_the_latest(tiny_model_dir, tmp_path, monkeypatch):
    config = tiny_config(tiny_model_dir, tmp_path / "run", eval={"before": False, "after": False})
    real_save, saves = checkpoint_module.torch.save, []

    def crash_on_second_checkpoint(obj, path, *args, **kwargs):
        if str(path).endswith("trainer_state.pt"):
            saves.append(path)
            if len(saves) == 2:
                real_save(obj, path, *args, **kwargs)
                with open(path, "r+b") as handle:  # the process dies half-way through writing
                    handle.truncate(100)
                # what torch.save raises when the disk fills up mid-write
                raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed (injected)")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", crash_on_second_checkpoint)
    with pytest.raises(SaveError) as error:
        train(config)
    message = str(error.value)
    assert "could not write checkpoint step 4" in message and "injected" in message and "free space there" in message
    assert "the last complete checkpoint" in message and "step-000002 is intact" in message
    monkeypatch.setattr(checkpoint_module.torch, "save", real_save)
    assert not list((tmp_path / "run" / "checkpoints").glob(".incomplete-*"))  # the half-written copy is gone
    checkpointer = checkpoint_module.Checkpointer(tmp_path / "run", keep=2)
    assert checkpointer.latest().name == "step-000002"  # the half-written step 4 never became a checkpoint
    resumed = train(config, ["output.resume=true"])
    assert [row["step"] for row in resumed.metrics if "loss" in row] == [1, 2, 3, 4]
