"""Every command that writes a run directory is refused while another run holds it: in one line, before it loads
anything.

The lock is held here, in the test's own process, with `RunDirLock` (an flock is held by an open
file, so a second open in the same process is refused as another process would be). Every recipe names a model
that does not exist: the lock line can only come first if it is found before any model is looked at.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import yaml

from polo.cli import main
from polo.runtime.run_lock import RunDirLock

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def write(path: Path, content: dict) -> str:
    """Return `path` as a string after writing `content` there as YAML."""
    path.write_text(yaml.safe_dump(content))
    return str(path)


def command(name: str, tmp_path: Path, locked: Path) -> list[str]:
    """Return the arguments of `polo NAME` writing into `locked`, with a model that does not exist."""
    no_model = str(tmp_path / "no-model-here")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1 + 1?", "response": "2"}\n')
    finetune = {"model": {"name": no_model}, "data": {"train_path": str(data)}, "output": {"dir": str(locked)}}
    if name == "train":
        recipe = {
            "model": {"name": no_model},
            "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1},
            "algorithm": {"group_size": 2},
            "train": {"prompts_per_step": 2},
            "output": {"dir": str(locked)},
        }
        return ["train", write(tmp_path / "rl.yaml", recipe)]
    if name in ("sft", "rm", "dpo"):
        return [name, write(tmp_path / f"{name}.yaml", finetune)]
    if name == "control":
        return ["control", str(RECIPES / "ppo_cartpole.yaml"), f"output.dir={locked}"]
    if name == "pipeline":
        return ["pipeline", str(RECIPES / "r1_arith.yaml"), f"pipeline.dir={locked}", f"pipeline.model={no_model}"]
    (locked / "config.yaml").write_text("{}\n")  # eval -o into a run directory
    return ["eval", "--model", no_model, "--output", str(locked / "eval.json")]


@pytest.mark.parametrize("name", ["train", "sft", "rm", "dpo", "control", "pipeline", "eval"])
def test_a_command_on_a_held_run_directory_stops_in_one_line_before_loading_anything(name, tmp_path, capsys):
    locked = tmp_path / "run"
    locked.mkdir()
    args = command(name, tmp_path, locked)
    held = RunDirLock(locked).acquire()  # as another process would: this process's own holds pass through owned_run_dir
    try:
        assert main(args) == 2
    finally:
        held.release()
    captured = capsys.readouterr()
    what = {"pipeline": "pipeline.dir", "eval": "the run directory of the output"}.get(name, "output.dir")
    instead = "write the output elsewhere" if name == "eval" else f"pick another {what}"
    assert captured.err.startswith(
        f"polo: error: {what} {locked} is in use by another polo run (pid {os.getpid()} on {socket.gethostname()}, "
    )
    assert captured.err.endswith(f"wait for it to finish, or {instead}\n") and captured.err.count("\n") == 1
    assert captured.out == ""
    assert sorted(path.name for path in locked.iterdir()) == (
        [] if name != "eval" else ["config.yaml"]
    )  # nothing written


def test_eval_into_a_plain_folder_or_reading_a_run_never_locks(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    held = RunDirLock(run_dir).acquire()  # a run in progress: reading it is fine
    try:
        assert main(["report", str(run_dir), "--output", str(tmp_path / "report.html")]) == 0
        # eval of a model into a plain folder takes no lock: it fails on the model, not on the lock
        assert (
            main(["eval", "--model", str(tmp_path / "no-model-here"), "--output", str(tmp_path / "out" / "eval.json")])
            == 2
        )
    finally:
        held.release()
    assert "in use by another polo run" not in capsys.readouterr().err
