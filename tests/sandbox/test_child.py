"""The sandbox's runner (polo.sandbox.child) as a module: its pure parts in-process, its status protocol
on the host without bubblewrap, and the text that runs in the sandbox being the module's own.

tests/sandbox/test_sandbox.py runs the same code inside bubblewrap; these tests can show where a
failure lies (in the runner's logic, or in the sandbox around it) and reach branches that a
contained run only reports (the exit and signal lines, SystemExit's codes, the words of each
isolation check)."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from polo.sandbox import child, runner
from polo.sandbox.runner import Isolation, SandboxError

HOST_NAMESPACES = {"net": 11, "pid": 12, "ipc": 13, "uts": 14, "mnt": 15, "user": 16}
# What a contained program's process sees: every namespace its own, the filter and no_new_privs on.
CONTAINED_STATUS = {"Seccomp": "2", "NoNewPrivs": "1", "CapEff": "0000000000000000"}


def config(**changes) -> dict:
    """Return a runner config like `runner._runner_config` writes, for a run as root."""
    return {
        "status_fd": 3,
        "program": "/run/polo/main.py",
        "uid": 1_500_000_123,
        "gid": 1_500_000_123,
        "host_namespaces": HOST_NAMESPACES,
        "cpu_seconds": 3,
        "memory_bytes": 256 * 2**20,
        "file_size_bytes": 2**20,
        "max_processes": 8,
        "max_open_files": 32,
        **changes,
    }


def test_a_fully_contained_process_reports_every_field_of_isolation():
    own = {name: inode + 100 for name, inode in HOST_NAMESPACES.items()}
    words = child.isolation_words(config(), CONTAINED_STATUS, own, 1_500_000_123, os.ST_RDONLY)
    assert words[0] == "bubblewrap" and len(words) == len(set(words))
    # Every word the runner can report is a field of Isolation, and together they are all of them.
    assert Isolation.from_words(words) == Isolation(**{f.name: True for f in dataclasses.fields(Isolation)})


def test_each_isolation_word_needs_its_own_evidence():
    own = dict(HOST_NAMESPACES, net=99)  # only the network namespace is new
    status = {"Seccomp": "0", "NoNewPrivs": "1", "CapEff": "00000000a80425fb"}
    words = child.isolation_words(config(uid=None), status, own, 1000, 0)
    assert words == ["bubblewrap", "network_namespace", "no_new_privs", "private_tmp"]
    # Without a PID namespace /proc is the host's; without the uid switch there is no throwaway uid.
    assert "private_proc" not in words and "throwaway_uid" not in words
    assert child.isolation_words(config(), {}, own, 5, 0) == ["bubblewrap", "network_namespace", "private_tmp"]


def test_proc_status_is_read_field_by_field():
    text = "Name:\tpython3\nUid:\t0\t0\t0\t0\nNoNewPrivs:\t1\nSeccomp:\t2\nCapEff:\t0000000000000000\n"
    fields = child.parse_proc_status(text)
    assert fields["Seccomp"] == "2" and fields["Uid"] == "0\t0\t0\t0" and fields["Name"] == "python3"
    with open("/proc/self/status", encoding="utf-8") as handle:
        assert {"Seccomp", "NoNewPrivs", "CapEff", "Uid"} <= set(child.parse_proc_status(handle.read()))


def test_rlimits_come_from_the_config():
    limits = dict(child.rlimits(config()))
    assert limits == {
        resource.RLIMIT_CPU: (3, 4),  # SIGXCPU at the soft limit, the kernel's SIGKILL one second later
        resource.RLIMIT_AS: (256 * 2**20, 256 * 2**20),
        resource.RLIMIT_FSIZE: (2**20, 2**20),
        resource.RLIMIT_NPROC: (8, 8),
        resource.RLIMIT_NOFILE: (32, 32),
        resource.RLIMIT_CORE: (0, 0),
    }


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), (256 + 7, 7), (-1, 255), (True, 1), ("no", 1)])
def test_system_exit_codes_map_as_the_interpreter_maps_them(code, status):
    assert child.exit_code(code) == status
    finished = subprocess.run([sys.executable, "-I", "-S", "-c", f"raise SystemExit({code!r})"], capture_output=True)
    assert finished.returncode == status  # the same as python itself


def forked_wait_status(action) -> int:
    """Return the wait status of a forked process that runs `action` (which must not return)."""
    pid = os.fork()
    if pid == 0:
        try:
            action()
        finally:
            os._exit(99)
    return os.waitpid(pid, 0)[1]


def test_wait_statuses_become_exit_and_signal_lines():
    assert child.wait_report(forked_wait_status(lambda: os._exit(3))) == "exit 3"
    assert child.wait_report(forked_wait_status(lambda: os._exit(0))) == "exit 0"
    killed = forked_wait_status(lambda: os.kill(os.getpid(), signal.SIGKILL))
    assert child.wait_report(killed) == f"signal {int(signal.SIGKILL)}"


def test_a_program_runs_as_main_under_its_own_name(capsys):
    program = "import sys\ndef f(x: int): return x\nprint(__name__, __file__, sys.argv[0] == 'x', f.__annotations__)\n"
    assert child.run_program(program) == 0
    # Annotations are objects: the runner's own `from __future__ import annotations` is not passed on.
    assert capsys.readouterr().out == "__main__ main.py False {'x': <class 'int'>}\n"


def test_a_failing_program_shows_its_own_traceback_only(capsys):
    program = "def inner():\n    raise ValueError('boom')\n\ninner()\n"
    assert child.run_program(program) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.rstrip().endswith("ValueError: boom")
    assert 'File "main.py", line 4, in <module>' in err and 'File "main.py", line 2, in inner' in err
    assert "child.py" not in err and "run_program" not in err


def test_system_exit_with_a_message_prints_it(capsys):
    assert child.run_program("import sys\nsys.exit('bye')\n") == 1
    assert capsys.readouterr().err == "bye\n"
    assert child.run_program("raise SystemExit(4)") == 4


def run_runner_on_the_host(tmp_path: Path, program: str, **changes) -> tuple[list[str], str]:
    """Return (status lines, stdout) of the runner started as the sandbox starts it, but without bubblewrap.

    Trusted programs only: nothing contains them but the runner's own rlimits. The config is this
    process's (its namespaces, no uid switch), so the runner should report this process's isolation.
    """
    program_path = tmp_path / "main.py"
    program_path.write_text(program)
    status_read, status_write = os.pipe()
    settings = host_config(status_fd=status_write, program=str(program_path), **changes)
    try:
        finished = subprocess.run(
            [sys.executable, "-I", "-S", "-c", runner.runner_source(), json.dumps(settings)],
            pass_fds=(status_write,),
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        os.close(status_write)
    with os.fdopen(status_read, encoding="utf-8") as status:
        lines = status.read().splitlines()
    assert finished.returncode == 0, finished.stderr
    return lines, finished.stdout


def host_config(**changes) -> dict:
    """Return a runner config for a run on the host: this process's namespaces, no uid switch."""
    return config(uid=None, gid=None, host_namespaces=runner._host_namespaces(), **changes)


def test_the_status_protocol_without_bubblewrap(tmp_path):
    lines, stdout = run_runner_on_the_host(tmp_path, "print('hello')\nraise SystemExit(3)\n")
    assert stdout == "hello\n"
    assert lines == ["iso " + " ".join(child.observed_isolation(host_config())), "exit 3"]
    assert "pid_namespace" not in lines[0] and "throwaway_uid" not in lines[0]  # the runner checks, not assumes
    lines, _ = run_runner_on_the_host(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert lines[1:] == [f"signal {int(signal.SIGTERM)}"]


def test_a_setup_failure_is_reported_as_such_and_the_program_never_runs(tmp_path):
    lines, stdout = run_runner_on_the_host(tmp_path, "print('ran')\n", memory_bytes="a lot")
    assert stdout == ""
    assert len(lines) == 2 and lines[0].startswith("setup-error TypeError: ")
    assert lines[1] == f"exit {child.SETUP_FAILED_EXIT}"


def test_the_sandbox_runs_the_module_text_as_shipped():
    source = runner.runner_source()
    assert source == Path(child.__file__).read_text(encoding="utf-8")
    assert 'if __name__ == "__main__":' in source and "main(sys.argv[1])" in source


def test_a_missing_runner_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "resources", types.SimpleNamespace(files=lambda package: tmp_path))  # no child.py
    runner.runner_source.cache_clear()
    try:
        with pytest.raises(SandboxError, match=r"^the code sandbox cannot run: its runner polo/sandbox/child.py"):
            runner.run_python("pass")
    finally:
        monkeypatch.undo()
        runner.runner_source.cache_clear()
    assert runner.run_python("pass").ok
