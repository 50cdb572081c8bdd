"""The sandbox's runner: the first process inside bubblewrap, which runs one program under its limits.

``polo.sandbox.runner`` reads this file's text (``runner_source``, through importlib.resources) and
starts it as ``python -I -S -c <this source> <config json>`` inside the sandbox, already under the
seccomp filter, in the new namespaces, as the PID namespace's init. It forks the program's
process, which drops to the throwaway uid and sets the rlimits before running the program; the
runner reports on the status pipe: ``iso <words>``, then ``exit <code>`` or ``signal <number>``
(``setup-error <why>`` when the sandbox itself could not be set up).

As root the runner keeps uid 0 (and CAP_SETUID/CAP_SETGID), so the program can neither signal nor
ptrace it. Without root they share a uid: as init the runner gets no signal it does not handle
(it ignores SIGINT, Python's one handler), and it makes itself non-dumpable, so that the program
cannot open its /proc/<pid>/mem and run code in it without the program's rlimits.

Inside the sandbox only the standard library exists, so this module imports nothing else
(tests/sandbox checks it). Importing it runs nothing: the tests call its pure parts in-process.
The config holds nothing the program may not know (its own limits, the host's namespace inodes
and a status descriptor that is closed before the program starts).
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import signal
import sys

# The program's name in its own tracebacks, ``__file__`` and ``sys.argv[0]``.
PROGRAM_FILE = "main.py"
SETUP_FAILED_EXIT = 125
_PR_SET_DUMPABLE = 4
# /proc/self/ns/<name> -> the word the runner reports when that namespace is not the host's.
NAMESPACE_WORDS = {
    "net": "network_namespace",
    "pid": "pid_namespace",
    "ipc": "ipc_namespace",
    "uts": "uts_namespace",
    "mnt": "mount_namespace",
    "user": "user_namespace",
}


def say(status_fd: int, line: str) -> None:
    """Write one line of the report to the status pipe."""
    os.write(status_fd, (line + "\n").encode())


def parse_proc_status(text: str) -> dict[str, str]:
    """Return ``/proc/<pid>/status`` as {field: value}."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def isolation_words(
    config: dict, proc_status: dict[str, str], namespaces: dict[str, int], uid: int, root_flags: int
) -> list[str]:
    """Return the isolation in force as the report's words, from what the program's process sees.

    ``namespaces`` maps each name of ``config["host_namespaces"]`` to this process's inode of it,
    ``uid`` is this process's uid and ``root_flags`` the ``f_flag`` of ``statvfs("/")``.
    """
    words = ["bubblewrap"] + [
        NAMESPACE_WORDS[name]
        for name, host_inode in config["host_namespaces"].items()
        if namespaces[name] != host_inode
    ]
    checks = (
        ("seccomp", proc_status.get("Seccomp") == "2"),
        ("no_new_privs", proc_status.get("NoNewPrivs") == "1"),
        ("capabilities_dropped", int(proc_status.get("CapEff", "1"), 16) == 0),
        ("throwaway_uid", uid == config["uid"]),
        ("read_only_root", root_flags & os.ST_RDONLY != 0),
        ("private_tmp", True),  # bwrap mounts /tmp as a fresh tmpfs whenever it runs at all
        ("private_proc", "pid_namespace" in words),
    )
    return words + [word for word, in_force in checks if in_force]


def observed_isolation(config: dict) -> list[str]:
    """Return `isolation_words` for this process, read from /proc and the file system."""
    with open("/proc/self/status", encoding="utf-8") as handle:
        proc_status = parse_proc_status(handle.read())
    namespaces = {name: os.stat("/proc/self/ns/" + name).st_ino for name in config["host_namespaces"]}
    return isolation_words(config, proc_status, namespaces, os.getuid(), os.statvfs("/").f_flag)


def rlimits(config: dict) -> list[tuple[int, tuple[int, int]]]:
    """Return the (resource, (soft, hard)) limits the program runs under.

    The CPU limit's hard value is one second above the soft one: the soft limit sends SIGXCPU,
    which the parent reports as ``cpu_limit``; the hard one is the kernel's SIGKILL behind it.
    """
    cpu = config["cpu_seconds"]
    same = (
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_size_bytes"]),
        (resource.RLIMIT_NPROC, config["max_processes"]),
        (resource.RLIMIT_NOFILE, config["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    )
    return [(resource.RLIMIT_CPU, (cpu, cpu + 1))] + [(limit, (value, value)) for limit, value in same]


def exit_code(code: object) -> int:
    """Return the exit status for ``SystemExit(code)``, as the interpreter itself would give it."""
    if isinstance(code, int):
        return code & 0xFF
    return 0 if code is None else 1


def wait_report(wait_status: int) -> str:
    """Return the report line for the program's wait status: ``signal <number>`` or ``exit <code>``."""
    if os.WIFSIGNALED(wait_status):
        return f"signal {os.WTERMSIG(wait_status)}"
    return f"exit {os.WEXITSTATUS(wait_status)}"


def run_program(source: str) -> int:
    """Return the exit status of running ``source`` as ``__main__`` in this process.

    An uncaught exception prints its traceback without this function's frame (the program's own
    frames only) and gives 1; ``SystemExit`` gives its code, printing a non-integer one as Python does.
    """
    namespace = {"__name__": "__main__", "__file__": PROGRAM_FILE, "__builtins__": builtins}
    try:
        # dont_inherit: the program must not take this module's `from __future__ import annotations`.
        exec(compile(source, PROGRAM_FILE, "exec", dont_inherit=True), namespace)
    except SystemExit as exc:
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
        return exit_code(exc.code)
    except BaseException as exc:
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        return 1
    return 0


def _set_up_program_process(config: dict, prctl) -> None:
    """Drop to the throwaway uid (as root) and set the rlimits, then report the isolation in force."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if config["uid"] is not None:
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(config["uid"])
    else:
        prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # the program itself is dumpable as usual (not its runner)
    for limit, value in rlimits(config):
        resource.setrlimit(limit, value)
    # Over-size writes then fail with EFBIG (a readable error) instead of killing silently.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    say(config["status_fd"], "iso " + " ".join(observed_isolation(config)))


def _program_process(config: dict, source: str, prctl) -> None:
    """Run the program in the forked process and exit with its status (never returns)."""
    try:
        _set_up_program_process(config, prctl)
    except BaseException as exc:
        say(config["status_fd"], f"setup-error {type(exc).__name__}: {exc}")
        os._exit(SETUP_FAILED_EXIT)
    os.close(config["status_fd"])
    sys.argv = [PROGRAM_FILE]
    code = 1
    try:
        code = run_program(source)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _non_dumpable_prctl(status_fd: int):
    """Return libc's prctl after making this process non-dumpable (exits, reporting why, if it cannot)."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        why = os.strerror(ctypes.get_errno())
        say(status_fd, f"setup-error the runner cannot make itself non-dumpable: {why}")
        os._exit(SETUP_FAILED_EXIT)
    return prctl


def main(config_json: str) -> None:
    """Run the program named by the config, report how it ended on the status pipe, and exit."""
    config = json.loads(config_json)
    status_fd = config["status_fd"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prctl = _non_dumpable_prctl(status_fd) if config["uid"] is None else None
    with open(config["program"], encoding="utf-8") as handle:
        source = handle.read()
    os.environ.pop("PWD", None)  # bwrap's --chdir sets it; the program's environment is exactly the three
    pid = os.fork()
    if pid == 0:
        _program_process(config, source, prctl)
    while True:  # as init, also reap the orphans the program leaves (they would count for RLIMIT_NPROC)
        reaped, wait_status = os.waitpid(-1, 0)
        if reaped == pid:
            break
    say(status_fd, wait_report(wait_status))
    os._exit(0)


if __name__ == "__main__":  # python -I -S -c <this source> <config json>
    main(sys.argv[1])
