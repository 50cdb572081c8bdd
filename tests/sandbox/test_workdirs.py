"""No sandbox working directory outlives its call: one left by a polo killed mid-call (SIGKILL) is removed by the
next call of any polo, and one a live call holds is never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polo.sandbox.runner import PROGRAM_FILE, WORKDIR_PREFIX, remove_abandoned_workdirs, run_python

# A polo process in the middle of a tool call: the sandboxed program prints "running" and sleeps. The host sees the
# program's stdout only inside run_python, so this process writes the marker file the moment that text arrives.
CALLER = """
import sys
from pathlib import Path

from polo.sandbox import runner

marker = Path(sys.argv[1])
pump = runner._Reader.pump


def pump_and_tell(reader, timeout):
    pump(reader, timeout)
    if b"running" in reader.buffers[reader.stdout_fd] and not marker.exists():
        marker.write_text("the sandboxed program is running")


runner._Reader.pump = pump_and_tell
runner.run_python("import time\\nprint('running', flush=True)\\ntime.sleep(600)", runner.SandboxLimits(timeout_s=600))
"""


def caller_in_a_call(temp: Path, marker: Path) -> subprocess.Popen:
    """Return a polo process whose sandboxed program is running (its marker written), its temp folder `temp`."""
    process = subprocess.Popen([sys.executable, "-c", CALLER, str(marker)], env={**os.environ, "TMPDIR": str(temp)})
    deadline = time.monotonic() + 300  # a bound on a hung start, not a timing assumption
    while not marker.exists():
        assert process.poll() is None, f"the caller ended with status {process.returncode} before its call ran"
        assert time.monotonic() < deadline, "the sandboxed program never said it was running"
        time.sleep(0.05)
    return process


def workdirs(temp: Path) -> set[Path]:
    return set(temp.glob(f"{WORKDIR_PREFIX}*"))


def test_a_killed_call_s_directory_is_removed_by_the_next_call_and_a_live_call_s_never(tmp_path, monkeypatch):
    temp = tmp_path / "tmp"
    temp.mkdir()
    killed = caller_in_a_call(temp, tmp_path / "killed")
    (left,) = workdirs(temp)
    killed.kill()  # SIGKILL: no handler, no finally, the sandbox dies with it
    killed.wait()
    assert (left / PROGRAM_FILE).is_file()  # what the killed call left behind

    live = caller_in_a_call(temp, tmp_path / "live")
    try:
        (held,) = workdirs(temp) - {left}
        starting = temp / f"{WORKDIR_PREFIX}starting"  # a run between mkdtemp and its lock: no program yet
        starting.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        assert run_python("print(6 * 7)").stdout == b"42\n"
        assert not left.exists()
        assert (held / PROGRAM_FILE).is_file() and starting.is_dir()
        assert live.poll() is None  # its call still runs
    finally:
        live.kill()
        live.wait()
    assert remove_abandoned_workdirs(str(temp)) == [str(held)]
    assert workdirs(temp) == {starting}
