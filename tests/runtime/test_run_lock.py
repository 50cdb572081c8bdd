"""`polo.runtime.run_lock` (one owner per run directory) and `polo.runtime.interrupt` (stop signals as requests)."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from polo.runtime.checkpoint import claim_output_dir, previous_run
from polo.runtime.interrupt import EXIT_STOPPED, RunStopped, StopNow, StopRequest
from polo.runtime.run_lock import LOCK_FILE, LockHolder, RunDirLock, RunDirLockedError, is_run_dir, owned_run_dir


def test_the_lock_file_names_its_holder_and_a_second_lock_is_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    with owned_run_dir(run_dir):
        holder = LockHolder.parse((run_dir / LOCK_FILE).read_text())
        assert (holder.pid, holder.host) == (str(os.getpid()), socket.gethostname()) and holder.started != "unknown"
        with pytest.raises(
            RunDirLockedError
        ) as refused:  # flock locks an open file, so the same process is refused too
            RunDirLock(run_dir).acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"output.dir {run_dir} is in use by another polo run (pid {os.getpid()} on {socket.gethostname()}, "
    )
    assert message.endswith("wait for it to finish, or pick another output.dir")


def test_letting_go_removes_the_lock_file_and_the_directory_the_lock_made(tmp_path):
    made, kept = tmp_path / "made", tmp_path / "kept"
    kept.mkdir()
    for directory in (made, kept):
        with owned_run_dir(directory):
            assert (directory / LOCK_FILE).exists()
        assert not (directory / LOCK_FILE).exists()
    assert not made.exists() and kept.is_dir()  # a refused run leaves no empty directory behind, and keeps the user's
    with owned_run_dir(made):
        (made / "metrics.jsonl").write_text("")
    assert made.is_dir()  # not empty: kept
    with owned_run_dir(made):  # taken again at once
        pass


def test_a_directory_this_process_holds_is_held_again_at_no_cost(tmp_path):
    with owned_run_dir(tmp_path / "stage", "the stage directory"):  # a pipeline holds its stage's directory ...
        with owned_run_dir(tmp_path / "stage"):  # ... then the stage's own run does
            pass
        assert (tmp_path / "stage" / LOCK_FILE).exists()  # still held by the outer one
        with pytest.raises(RunDirLockedError, match="the stage directory .* or pick another the stage directory"):
            RunDirLock(tmp_path / "stage", "the stage directory").acquire()
    assert not (tmp_path / "stage").exists()


def test_a_stale_lock_file_is_only_text(tmp_path):
    (tmp_path / LOCK_FILE).write_text(LockHolder("999999", "elsewhere", "yesterday", "polo train x.yaml").text())
    with owned_run_dir(tmp_path):
        assert f"pid: {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()


def test_the_lock_file_is_not_an_earlier_run_and_overwrite_keeps_it(tmp_path):
    with owned_run_dir(tmp_path):
        assert previous_run(tmp_path) == [] and is_run_dir(tmp_path)
        claim_output_dir(tmp_path, overwrite=False, resume=False)  # only the lock: a fresh run may start
        (tmp_path / "metrics.jsonl").write_text("{}\n")
        claim_output_dir(tmp_path, overwrite=True, resume=False)
        assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK_FILE]
    assert not is_run_dir(tmp_path)


@pytest.fixture
def sighup_not_ignored():
    """Let SIGHUP act for the test even when the suite runs under nohup (StopRequest leaves an ignored SIGHUP be)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


def test_a_stop_signal_is_a_request_shared_by_nested_requests_and_a_second_one_stops_at_once(sighup_not_ignored):
    interrupt = signal.getsignal(signal.SIGINT)  # ignored in a suite started in the background (`make test &`)
    said = []
    with StopRequest(said.append) as outer:
        with StopRequest(said.append) as inner:
            assert not inner.requested
            signal.raise_signal(signal.SIGTERM)
            assert inner.requested and outer.requested and inner.signum == signal.SIGTERM
            with pytest.raises(StopNow) as second:
                signal.raise_signal(signal.SIGHUP)
        assert outer.requested  # the inner one's exit leaves the outer's record
    assert said == ["polo: SIGTERM: stopping after this step and saving a checkpoint (send SIGTERM again to abort now)"]
    assert second.value.exit_status == 128 + signal.SIGHUP
    with StopRequest(said.append) as fresh:  # a new outermost request starts clean
        assert not fresh.requested
        signal.raise_signal(signal.SIGHUP)
        assert fresh.signum == signal.SIGHUP
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is interrupt


def test_a_stopped_run_says_where_it_stopped_and_exits_with_its_status(tmp_path):
    stopped = RunStopped(signal.SIGTERM, 3, tmp_path / "step-000003")
    assert str(stopped) == f"stopped by SIGTERM after step 3; saved {tmp_path / 'step-000003'}"
    assert stopped.exit_status == EXIT_STOPPED == 75 and isinstance(stopped, KeyboardInterrupt)
    assert (
        str(stopped.in_stage("b_reason"))
        == f"stopped by SIGTERM in stage b_reason after step 3; saved {tmp_path / 'step-000003'}"
    )
    assert str(RunStopped(signal.SIGHUP, 0, None)) == "stopped by SIGHUP before the first step"
    assert (
        str(RunStopped(signal.SIGTERM, None, None, where="a_cold_start"))
        == "stopped by SIGTERM after stage a_cold_start finished"
    )
    assert RunStopped(signal.SIGINT, 2, None).exit_status == 130
