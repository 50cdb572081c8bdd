"""A run directory has one owner, and a scheduler's SIGTERM is a clean stop: `polo train` run as subprocesses.

The children are the real `polo` executable on the tiny random model. To stop one at a chosen
point, `tests/signal_hook/sitecustomize.py` (prepended to PYTHONPATH) wraps a polo function so
that the child sends itself SIGTERM there, or waits once it holds its lock; the library has no
test hooks of its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from test_trainer import final_weights, tiny_config, without_times

from polo.rl.train import train
from polo.runtime.interrupt import EXIT_STOPPED
from polo.runtime.metrics import read_metrics
from polo.runtime.run_lock import LOCK_FILE

POLO = Path(sys.executable).with_name("polo")
HOOK = Path(__file__).resolve().parents[1] / "signal_hook"
QUIET = {"progress": False, "report_to": [], "plots": False}
TIMEOUT = 600  # generous: CI machines can be busy


def child_env(**variables: str) -> dict:
    """Return this process's environment with the test hook prepended to PYTHONPATH (never replacing it) and
    `variables` set."""
    env = {**os.environ, **variables}
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def recipe(tmp_path: Path, model_dir: Path, name: str, output_dir: Path, **sections) -> Path:
    """Write a tiny `polo train` recipe (no evaluation, nothing but metrics and checkpoints) and return its path."""
    config = tiny_config(
        model_dir, output_dir, eval={"before": False, "after": False}, output={**QUIET, "dir": str(output_dir)}
    )
    for section, values in sections.items():
        config[section].update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(*args: str, **variables: str) -> subprocess.Popen:
    """Start `polo args...` with the hook's `variables`; stdout and stderr are captured as text."""
    return subprocess.Popen(
        [str(POLO), *args], env=child_env(**variables), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(child: subprocess.Popen) -> tuple[int, str, str]:
    """Return (exit status, stdout, stderr) of `child` once it ends."""
    out, err = child.communicate(timeout=TIMEOUT)
    return child.returncode, out, err


def wait_for_lock_holder(lock: Path, child: subprocess.Popen) -> None:
    """Wait until `child` has written itself into `lock` (it holds the lock from then on)."""
    deadline = time.time() + TIMEOUT
    while child.poll() is None and time.time() < deadline:
        if lock.exists() and f"pid: {child.pid}" in lock.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"the child never took the lock: {finish(child)}")


def steps_logged(run_dir: Path) -> list[int]:
    """Return the steps of the training rows in `run_dir`'s metrics.jsonl, in order."""
    return [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in row]


def test_two_runs_on_one_directory_one_runs_and_the_other_says_who_holds_it(tiny_model_dir, tmp_path):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    first = recipe(tmp_path, tiny_model_dir, "first", run_dir, train={"steps": 3})
    second = recipe(tmp_path, tiny_model_dir, "second", run_dir, train={"steps": 3, "seed": 9})
    # the first holds the lock, and has written nothing else yet: without the lock the second would pass every check
    winner = start("train", str(first), POLO_TEST_HOLD_UNTIL=str(release))
    wait_for_lock_holder(run_dir / LOCK_FILE, winner)
    assert sorted(path.name for path in run_dir.iterdir()) == [LOCK_FILE]

    status, out, err = finish(start("train", str(second)))
    assert status == 2 and out == "", (out, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert re.fullmatch(
        rf"polo: error: output\.dir {re.escape(str(run_dir))} is in use by another polo run "
        rf"\(pid {winner.pid} on {re.escape(os.uname().nodename)}, '.*polo train .*first\.yaml', started \S+\): "
        r"wait for it to finish, or pick another output\.dir",
        err.strip(),
    ), err

    release.touch()
    status, out, err = finish(winner)
    assert status == 0, err
    assert steps_logged(run_dir) == [1, 2, 3]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["seed"] == 3  # the winner's, alone
    assert not (run_dir / LOCK_FILE).exists()  # let go of on the way out


def test_a_lock_left_by_a_killed_run_does_not_block_the_next(tiny_model_dir, tmp_path):
    run_dir, never = tmp_path / "run", tmp_path / "never"
    path = recipe(tmp_path, tiny_model_dir, "run", run_dir, train={"steps": 2})
    killed = start("train", str(path), POLO_TEST_HOLD_UNTIL=str(never))
    wait_for_lock_holder(run_dir / LOCK_FILE, killed)
    killed.send_signal(signal.SIGKILL)  # no chance to let go: the kernel does it
    finish(killed)
    assert f"pid: {killed.pid}" in (run_dir / LOCK_FILE).read_text()  # the file stays, naming a dead process

    status, out, err = finish(start("train", str(path)))
    assert status == 0, err
    assert steps_logged(run_dir) == [1, 2]


def test_sigterm_in_sampling_checkpointing_and_update_then_resume_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """Four processes for one 4-step run: SIGTERM in step 1's sampling, step 2's checkpoint write, step 3's update."""
    straight = train(
        tiny_config(tiny_model_dir, tmp_path / "straight", eval={"before": False, "after": False}, output=QUIET)
    )
    run_dir = tmp_path / "stopped"
    path = recipe(tmp_path, tiny_model_dir, "stopped", run_dir)
    resume = ["train", str(path), "output.resume=true"]
    stops = [
        (["train", str(path)], "sampling:1", 1),
        (resume, "checkpoint:2", 2),  # a due checkpoint being written: it completes, and the run stops on it
        (resume, "update:1", 3),  # the first update of this process is step 3
    ]
    for args, phase, step in stops:
        status, out, err = finish(start(*args, POLO_TEST_SIGTERM=phase))
        checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
        assert status == EXIT_STOPPED, (phase, out, err)
        assert (
            "polo: SIGTERM: stopping after this step and saving a checkpoint (send SIGTERM again to abort now)" in out
        )
        assert err.strip().splitlines()[-1] == (
            f"polo: stopped by SIGTERM after step {step}; saved {checkpoint}; "
            f"resume with: polo train {path} output.resume=true"
        ), (phase, err)
        assert (checkpoint / "trainer_state.pt").exists() and steps_logged(run_dir) == list(range(1, step + 1))
        assert not (run_dir / LOCK_FILE).exists()

    status, out, err = finish(start(*resume))
    assert status == 0, err
    assert without_times(read_metrics(run_dir / "metrics.jsonl")) == without_times(
        straight.metrics
    )  # contiguous, no step twice
    a, b = final_weights(tmp_path / "straight"), final_weights(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
