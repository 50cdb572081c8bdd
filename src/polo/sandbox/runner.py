"""Run untrusted Python programs in a contained child process (for code-execution rewards).

``run_python(source, limits)`` returns a ``SandboxResult``; it never raises because of what the
program does, only ``SandboxError`` when the sandbox itself cannot run on this machine (with one
line saying why). Every program runs under bubblewrap (``polo.sandbox.bwrap``: a fresh root
holding only the interpreter, its standard library and their shared libraries, read-only; a
private tmpfs working directory and ``/tmp``; new network, PID, IPC, UTS and cgroup namespaces)
and a seccomp filter (``polo.sandbox.seccomp``: no sockets, namespaces, io_uring, bpf, perf,
keyrings, ptrace or mounts). Inside, the program runs as a throwaway uid (as root; as a normal
user, in a user namespace as that user) with no
capabilities, ``no_new_privs``, an empty environment, ``python -I -S`` and rlimits on CPU,
memory, file size, processes and open files; the parent enforces a wall-clock timeout and caps
stdout and stderr at ``max_output_bytes``. docs/sandbox.md says what is and is not contained.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources

from polo.sandbox import bwrap
from polo.sandbox.child import PROGRAM_FILE
from polo.sandbox.seccomp import SeccompUnavailable, compiled_filter

logger = logging.getLogger(__name__)

# Throwaway uids live far above any real account; each run draws its own, so RLIMIT_NPROC counts
# only that run's processes and two concurrent sandboxes cannot signal each other.
_THROWAWAY_ID_BASE = 1_500_000_000
_THROWAWAY_ID_SPAN = 1 << 24
_READ_CHUNK = 65536
# A run's working directory on the host (it holds the program, bound read-only into the sandbox).
WORKDIR_PREFIX = "polo-sandbox-"


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (never raised for what the program does)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed program; the defaults suit short test programs.

    ``cpu_seconds=None`` means ``ceil(timeout_s)``. ``disk_bytes`` sizes each private tmpfs (the
    working directory and ``/tmp``).
    """

    timeout_s: float = 5.0
    cpu_seconds: int | None = None
    memory_bytes: int = 512 * 2**20
    file_size_bytes: int = 1 * 2**20
    max_processes: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 * 2**10
    disk_bytes: int = 16 * 2**20

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        for name in (
            "memory_bytes",
            "file_size_bytes",
            "max_processes",
            "max_open_files",
            "max_output_bytes",
            "disk_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.cpu_seconds is not None and (
            isinstance(self.cpu_seconds, bool) or not isinstance(self.cpu_seconds, int) or self.cpu_seconds < 1
        ):
            raise ValueError(f"cpu_seconds must be None or an integer >= 1, got {self.cpu_seconds!r}")

    @property
    def cpu_limit(self) -> int:
        """Return the RLIMIT_CPU soft limit in seconds."""
        return self.cpu_seconds if self.cpu_seconds is not None else max(1, math.ceil(self.timeout_s))


@dataclass(frozen=True)
class Isolation:
    """Which containment the kernel granted a run (True = in force)."""

    bubblewrap: bool = False
    seccomp: bool = False
    network_namespace: bool = False
    pid_namespace: bool = False
    ipc_namespace: bool = False
    uts_namespace: bool = False
    mount_namespace: bool = False
    read_only_root: bool = False
    private_tmp: bool = False
    private_proc: bool = False
    user_namespace: bool = False
    throwaway_uid: bool = False
    capabilities_dropped: bool = False
    no_new_privs: bool = False

    @classmethod
    def from_words(cls, words: list[str]) -> Isolation:
        """Return the Isolation named by the child's report (unknown words are ignored)."""
        known = set(cls.__dataclass_fields__)
        return cls(**{word: True for word in words if word in known})

    def summary(self) -> str:
        """Return one line saying what is and is not in force."""
        granted = [name for name in self.__dataclass_fields__ if getattr(self, name)]
        missing = [name for name in self.__dataclass_fields__ if not getattr(self, name)]
        return (
            f"in force: {', '.join(granted) or 'rlimits, timeout, output cap, empty env and cwd only'}"
            f"; not in force: {', '.join(missing) or 'nothing'}"
        )


@dataclass
class SandboxResult:
    """What happened to one sandboxed program.

    ``status`` is one of ``"ok"`` (exit 0), ``"exit"`` (non-zero exit), ``"timeout"`` (wall
    clock), ``"cpu_limit"`` (RLIMIT_CPU), ``"signal"`` (killed by another signal),
    ``"output_limit"`` (wrote more than ``max_output_bytes``) or ``"runner_died"`` (the sandbox's
    own runner process was killed, e.g. by the program). ``reason`` says it in words.
    """

    status: str
    reason: str
    returncode: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    duration_s: float
    isolation: Isolation = field(default_factory=Isolation)

    @property
    def ok(self) -> bool:
        """Return True when the program exited with status 0 within every limit."""
        return self.status == "ok"


@functools.cache
def runner_source() -> str:
    """Return the text of the sandbox's runner, `polo.sandbox.child`, as the package ships it.

    It runs as ``python -I -S -c <text>`` inside the sandbox, where polo itself is out of sight, so
    the text goes in on the command line instead of being imported there.
    """
    return shipped_text("polo.sandbox", "child.py", "the code sandbox", "runner")


def shipped_text(package: str, name: str, user: str, role: str) -> str:
    """Return the text of the file ``name`` of the installed ``package``, a program that runs in the sandbox.

    No program can run without it: a file that cannot be read is a SandboxError saying that ``user``
    cannot run, naming the file as its ``role``.
    """
    try:
        return resources.files(package).joinpath(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        where = f"{package.replace('.', '/')}/{name}"
        raise SandboxError(
            f"{user} cannot run: its {role} {where} cannot be read from the installed polo package ({exc}); "
            "reinstall polo"
        ) from exc


_isolation_logged = False
_detected: Isolation | None = None


def child_environment(workdir: str) -> dict[str, str]:
    """Return the complete environment a sandboxed program sees (nothing is inherited)."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}


def _throwaway_ids() -> tuple[int, int] | tuple[None, None]:
    """Return a fresh (uid, gid) for the child when running as root, else (None, None)."""
    if os.geteuid() != 0:
        return None, None
    ident = _THROWAWAY_ID_BASE + secrets.randbelow(_THROWAWAY_ID_SPAN)
    return ident, ident


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL bwrap and its process group.

    bwrap runs with ``--die-with-parent`` and is the parent of the namespace's init, so the kernel
    kills the whole PID namespace (the program's daemonised children too) when bwrap dies.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class _Reader:
    """Collects the child's stdout, stderr and status pipe, each capped."""

    def __init__(self, process: subprocess.Popen, status_fd: int, cap: int) -> None:
        self.cap = cap
        self.buffers = {
            process.stdout.fileno(): bytearray(),
            process.stderr.fileno(): bytearray(),
            status_fd: bytearray(),
        }
        self.stdout_fd = process.stdout.fileno()
        self.stderr_fd = process.stderr.fileno()
        self.status_fd = status_fd
        self.selector = selectors.DefaultSelector()
        for fd in self.buffers:
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ)
        self.open_fds = set(self.buffers)
        self.over_cap = False

    def pump(self, timeout: float) -> None:
        """Read whatever is ready within ``timeout`` seconds."""
        for key, _ in self.selector.select(timeout):
            fd = key.fd
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                self.selector.unregister(fd)
                self.open_fds.discard(fd)
                continue
            buffer = self.buffers[fd]
            room = (self.cap if fd != self.status_fd else _READ_CHUNK) - len(buffer)
            buffer += chunk[: max(room, 0)]
            if len(chunk) > room and fd != self.status_fd:
                self.over_cap = True

    def status_lines(self) -> list[str]:
        """Return the complete lines the runner has reported so far."""
        text = self.buffers[self.status_fd].decode(errors="replace")
        return text.split("\n")[:-1]

    def close(self) -> None:
        """Release the selector."""
        self.selector.close()


def _parse_status(lines: list[str]) -> dict[str, str]:
    """Return the runner's report as {keyword: rest of line}."""
    report = {}
    for line in lines:
        keyword, _, rest = line.partition(" ")
        report[keyword] = rest
    return report


def _signal_name(number: int) -> str:
    """Return e.g. "SIGKILL" for 9 (or "signal 99" when unknown)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _classify(
    report: dict[str, str], timed_out: bool, over_cap: bool, limits: SandboxLimits, stderr: bytes
) -> tuple[str, str, int | None, int | None]:
    """Return (status, reason, returncode, signal) for a finished run."""
    if timed_out:
        return "timeout", f"wall-clock timeout after {limits.timeout_s:g} s", None, None
    if over_cap:
        return "output_limit", f"output exceeded {limits.max_output_bytes} bytes", None, None
    if "signal" in report:
        number = int(report["signal"])
        if number == signal.SIGXCPU:
            return "cpu_limit", f"CPU time limit ({limits.cpu_limit} s) exceeded", None, number
        return "signal", f"killed by {_signal_name(number)}", None, number
    if "exit" in report:
        code = int(report["exit"])
        if code == 0:
            return "ok", "exited with status 0", 0, None
        last_line = stderr.decode(errors="replace").strip().rpartition("\n")[2][:200]
        return "exit", f"exited with status {code}" + (f": {last_line}" if last_line else ""), code, None
    return "runner_died", "the sandbox runner was killed before the program finished", None, None


def run_python(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Return the outcome of running ``source`` as ``main.py`` in a fresh sandbox.

    Raises SandboxError only when the sandbox cannot run on this machine, never because of the program.
    """
    limits = SandboxLimits() if limits is None else limits
    seccomp_program = _seccomp_program()
    try:
        bwrap.python_files()  # the first call scans libraries with ldd: not the program's time
    except bwrap.ToolUnavailable as exc:
        raise SandboxError(f"the code sandbox cannot run on this machine: {exc}") from exc
    workdir = _Workdir.create(source)
    uid, gid = _throwaway_ids()
    status_read, status_write = os.pipe()
    seccomp_read = _seccomp_pipe(seccomp_program)
    config = _runner_config(limits, status_write, uid, gid)
    started = time.monotonic()
    try:
        process = _start_runner(config, limits, workdir, status_write, seccomp_read)
    except BaseException:
        os.close(status_read)
        workdir.remove()
        raise
    finally:
        os.close(status_write)
        os.close(seccomp_read)
    reader = _Reader(process, status_read, limits.max_output_bytes)
    timed_out = False
    try:
        timed_out = _watch(reader, process, started + limits.timeout_s)
    finally:
        duration = _release(process, reader, status_read, workdir, started)
    report = _parse_status(reader.status_lines())
    if "setup-error" in report:
        raise SandboxError(f"could not set up the sandbox: {report['setup-error']}")
    if "iso" not in report and not timed_out:
        _raise_if_tool_failed(reader, process)
    return _result(report, reader, timed_out, limits, duration)


def _seccomp_program() -> bytes:
    """Return the compiled syscall filter, or raise SandboxError saying why it cannot be built."""
    try:
        return compiled_filter()
    except SeccompUnavailable as exc:
        raise SandboxError(f"the code sandbox cannot run on this machine: {exc}") from exc


def _seccomp_pipe(program: bytes) -> int:
    """Return the read end of a pipe holding ``program`` (bwrap reads it to EOF; a few hundred bytes fit)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)
    finally:
        os.close(write_end)
    return read_end


def _watch(reader: _Reader, process: subprocess.Popen, deadline: float) -> bool:
    """Return True when the run hit the wall-clock deadline, after reading until it is over."""
    while reader.open_fds:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True
        reader.pump(min(remaining, 0.5))
        if _should_stop_watching(reader, process, _parse_status(reader.status_lines())):
            return False
    return False


def _raise_if_tool_failed(reader: _Reader, process: subprocess.Popen) -> None:
    """Raise SandboxError saying why the sandbox never reached the program.

    Called when the runner reported nothing before it ended (nor timed out): no program ran, so
    no completion is to blame, and scoring it 0 would hide a machine that cannot score anything.
    Either bwrap could not build the sandbox (it says why on stderr, e.g. no user namespace for
    this user) or the interpreter could not start inside it.
    """
    stderr = bytes(reader.buffers[reader.stderr_fd]).decode(errors="replace").strip()
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if lines and lines[0].startswith("bwrap:"):
        line = lines[0][:300]
        if os.geteuid() != 0 and bwrap.is_user_namespace_failure(line):
            raise SandboxError(
                f"the code sandbox cannot run on this machine: bwrap cannot create a user namespace for uid "
                f"{os.geteuid()} ({line}); {bwrap.user_namespace_advice()}, or run polo as root (see docs/sandbox.md)"
            )
        raise SandboxError(f"the code sandbox cannot run on this machine: {line} (see docs/sandbox.md)")
    # Its own words: "Fatal Python error: ..." (no standard library), the loader's "error while
    # loading shared libraries: ...", or the last line of a traceback.
    fatal = next((line for line in lines if line.startswith("Fatal Python error")), None)
    said = fatal or (lines[-1] if lines and lines[0].startswith("Traceback") else lines[0] if lines else "")
    said = f": {said[:300]}" if said else ", and said nothing"
    raise SandboxError(
        f"the code sandbox cannot run on this machine: its Python ({bwrap.interpreter()}) did not start inside "
        f"the sandbox (exit status {process.returncode}{said}) (see docs/sandbox.md)"
    )


@dataclass
class _Workdir:
    """A run's working directory on the host, locked (``flock``) by the process that runs it until it is removed.

    The lock is the kernel's: it goes when its owner dies, however it dies (a SIGKILL during a
    call leaves the directory behind), and it belongs to the open directory, never to a pid that
    another process may reuse. So the next run of any polo removes a directory nobody holds
    (`remove_abandoned_workdirs`), and never one that a live run, of this process or another, holds.
    """

    path: str
    program: str
    lock: int | None

    @classmethod
    def create(cls, source: str) -> _Workdir:
        """Return a fresh working directory holding ``source`` as the program, locked, after sweeping the
        abandoned ones."""
        remove_abandoned_workdirs(tempfile.gettempdir())
        path = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
        workdir = cls(path, os.path.join(path, PROGRAM_FILE), None)
        try:
            # Locked before the program is written: a directory that holds a program and can be locked has no owner.
            workdir.lock = _lock_directory(path, blocking=True)
            with open(workdir.program, "w", encoding="utf-8") as handle:
                handle.write(source)
        except BaseException:
            workdir.remove()
            raise
        return workdir

    def remove(self) -> None:
        """Remove the directory, then release its lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


def _lock_directory(path: str, blocking: bool) -> int | None:
    """Return a descriptor of directory ``path`` holding its exclusive ``flock``, or None when it cannot be had
    (held by another run, gone, or a file system without flock, where the sweep leaves every directory alone)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        os.close(descriptor)
        return None
    return descriptor


def remove_abandoned_workdirs(parent: str) -> list[str]:
    """Return the working directories removed from ``parent``: this user's, that hold a program and no run holds.

    They are what a polo killed during a call (SIGKILL, the machine's OOM killer) left. A directory
    without its program yet may be a live run's between ``mkdtemp`` and its lock: it is left alone.
    """
    try:
        candidates = [entry.path for entry in os.scandir(parent) if entry.name.startswith(WORKDIR_PREFIX)]
    except OSError:
        return []
    removed = []
    for path in candidates:
        descriptor = _lock_directory(path, blocking=False)
        if descriptor is None:
            continue
        try:
            mine = os.fstat(descriptor).st_uid == os.geteuid()
            if mine and os.path.isfile(os.path.join(path, PROGRAM_FILE)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            os.close(descriptor)
    return removed


def _host_namespaces() -> dict[str, int]:
    """Return the inode of each of this process's namespaces, for the runner to compare with its own."""
    inodes = {}
    for name in ("net", "pid", "ipc", "uts", "mnt", "user"):
        try:
            inodes[name] = os.stat(f"/proc/self/ns/{name}").st_ino
        except OSError:
            continue
    return inodes


def _runner_config(limits: SandboxLimits, status_fd: int, uid: int | None, gid: int | None) -> dict:
    """Return the settings the runner script reads from its command line."""
    return {
        "status_fd": status_fd,
        "program": bwrap.PROGRAM_PATH,
        "uid": uid,
        "gid": gid,
        "host_namespaces": _host_namespaces(),
        "cpu_seconds": limits.cpu_limit,
        "memory_bytes": limits.memory_bytes,
        "file_size_bytes": limits.file_size_bytes,
        "max_processes": limits.max_processes,
        "max_open_files": limits.max_open_files,
    }


def _start_runner(
    config: dict, limits: SandboxLimits, workdir: _Workdir, status_write: int, seccomp_read: int
) -> subprocess.Popen:
    """Return bwrap started on the runner (the caller removes the working directory when this raises)."""
    runner = [bwrap.interpreter(), "-I", "-S", "-c", runner_source(), json.dumps(config)]
    try:
        argv = bwrap.command(workdir.path, workdir.program, limits.disk_bytes, seccomp_read, runner)
        return subprocess.Popen(
            argv,
            cwd=workdir.path,
            env=child_environment(workdir.path),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_write, seccomp_read),
            start_new_session=True,
            close_fds=True,
        )
    except bwrap.ToolUnavailable as exc:
        raise SandboxError(f"the code sandbox cannot run on this machine: {exc}") from exc


def _should_stop_watching(reader: _Reader, process: subprocess.Popen, report: dict[str, str]) -> bool:
    """Return whether the run is over: finished, failed to set up, over the output cap, or its runner killed."""
    if reader.over_cap or "setup-error" in report:
        return True
    reported = "exit" in report or "signal" in report
    if reader.status_fd not in reader.open_fds and process.poll() is not None and not reported:
        return True  # bwrap or the runner died before reporting
    if reported and reader.status_fd not in reader.open_fds:
        # Finished: take what is already in the pipes, without waiting for stragglers
        # (a daemonised grandchild may hold them open).
        reader.pump(0)
        return True
    return False


def _release(process: subprocess.Popen, reader: _Reader, status_read: int, workdir: _Workdir, started: float) -> float:
    """Return the run's duration in seconds, after killing what is left of it and releasing its pipes and files."""
    _kill(process)
    process.wait()
    duration = time.monotonic() - started
    reader.close()
    process.stdout.close()
    process.stderr.close()
    os.close(status_read)
    workdir.remove()
    return duration


def _result(
    report: dict[str, str], reader: _Reader, timed_out: bool, limits: SandboxLimits, duration: float
) -> SandboxResult:
    """Return the `SandboxResult` of a finished run (logging the isolation the first time)."""
    stdout = bytes(reader.buffers[reader.stdout_fd])
    stderr = bytes(reader.buffers[reader.stderr_fd])
    status, reason, returncode, signal_number = _classify(report, timed_out, reader.over_cap, limits, stderr)
    isolation = Isolation.from_words(report.get("iso", "").split())
    _log_isolation_once(isolation)
    return SandboxResult(status, reason, returncode, signal_number, stdout, stderr, duration, isolation)


def _log_isolation_once(isolation: Isolation) -> None:
    """Log the isolation in force the first time a program runs in this process."""
    global _isolation_logged
    if _isolation_logged:
        return
    _isolation_logged = True
    complete = isolation.network_namespace and isolation.pid_namespace and isolation.seccomp
    level = logging.INFO if complete else logging.WARNING
    logger.log(level, "code sandbox isolation %s", isolation.summary())


def detect_isolation(limits: SandboxLimits | None = None) -> Isolation:
    """Return the isolation this machine grants, found by running one trivial program (cached)."""
    global _detected
    if _detected is None or limits is not None:
        result = run_python("pass", limits)
        if limits is not None:
            return result.isolation
        _detected = result.isolation
    return _detected


__all__ = [
    "Isolation",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "child_environment",
    "detect_isolation",
    "remove_abandoned_workdirs",
    "run_python",
    "runner_source",
    "shipped_text",
]
