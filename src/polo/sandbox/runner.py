"""Run untrusted Python programs in a contained child process (for code-execution rewards).

``run_python(source, limits)`` returns a ``SandboxResult``; it never raises because of what the
program does (only when the sandbox itself cannot be set up). Every run gets:

- its own empty working directory (removed afterwards) and an empty environment
  (``PATH=/usr/bin:/bin``, ``LANG=C.UTF-8``, ``HOME`` = the working directory; nothing inherited);
- ``python -I -S`` (isolated mode, no site-packages: the standard library only);
- resource limits set with ``setrlimit`` in the child: CPU seconds, address space, file size,
  processes, open files, no core dumps;
- a wall-clock timeout that kills the whole process group (and the PID namespace when there is
  one); stdout and stderr are each read up to ``max_output_bytes`` and the child is killed when
  it writes more, so a program printing a gigabyte costs neither memory nor disk.

Where the kernel allows it (detected per run, reported in ``SandboxResult.isolation``; see
``detect_isolation()`` and docs/sandbox.md) the child also gets:

- new network, PID, IPC and mount namespaces: no network at all (not even loopback), no view of or
  signal to any process outside the sandbox, a private ``/proc``;
- a read-only, nosuid view of the whole file system, with fresh size-limited tmpfs mounts on the
  working directory and ``/tmp`` that vanish with the namespace;
- as root: a throwaway uid/gid (one per run, no supplementary groups), so RLIMIT_NPROC is enforced
  (root ignores it) and root-owned files are out of reach; without root: a user namespace, with
  every capability dropped before the program starts;
- ``PR_SET_NO_NEW_PRIVS``, so setuid binaries cannot raise privileges.

What is not contained: CPU cache/timing side channels, reading world-readable files, and (without
namespaces) the network and the file system as the parent's user sees them. The module logs the
isolation in force once per process at INFO, and at WARNING when there is no namespace isolation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PROGRAM_FILE = "main.py"
# Throwaway uids live far above any real account; each run draws its own, so RLIMIT_NPROC counts
# only that run's processes and two concurrent sandboxes cannot signal each other.
_THROWAWAY_ID_BASE = 1_500_000_000
_THROWAWAY_ID_SPAN = 1 << 24
_SETUP_FAILED_EXIT = 125
_READ_CHUNK = 65536


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (never raised for what the program does)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed program; the defaults suit short test programs.

    ``cpu_seconds=None`` means ``ceil(timeout_s)``. ``disk_bytes`` sizes each private tmpfs (the
    working directory and ``/tmp``) when mount namespaces are available.
    """

    timeout_s: float = 5.0
    cpu_seconds: int | None = None
    memory_bytes: int = 512 * 2**20
    file_size_bytes: int = 1 * 2**20
    max_processes: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 * 2**10
    disk_bytes: int = 16 * 2**20
    namespaces: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        for name in ("memory_bytes", "file_size_bytes", "max_processes", "max_open_files",
                     "max_output_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.cpu_seconds is not None and (
            isinstance(self.cpu_seconds, bool) or not isinstance(self.cpu_seconds, int)
            or self.cpu_seconds < 1
        ):
            raise ValueError(f"cpu_seconds must be None or an integer >= 1, got {self.cpu_seconds!r}")

    @property
    def cpu_limit(self) -> int:
        """Return the RLIMIT_CPU soft limit in seconds."""
        return self.cpu_seconds if self.cpu_seconds is not None else max(1, math.ceil(self.timeout_s))


@dataclass(frozen=True)
class Isolation:
    """Which containment the kernel granted a run (True = in force)."""

    network_namespace: bool = False
    pid_namespace: bool = False
    ipc_namespace: bool = False
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


# The child's start-up code, run as ``python -I -S -c _CHILD <config json>`` in the new session.
# It reads the program, enters namespaces, forks the program's process (PID 1 of the new PID
# namespace when there is one), sets up mounts, drops privileges and limits, and reports on the
# status pipe: "iso <words>", "pid <pid>", then "exit <code>" or "signal <number>".
_CHILD = r'''
import os, sys, json, signal, resource
cfg = json.loads(sys.argv[1])
status_fd = cfg["status_fd"]
def say(line):
    os.write(status_fd, (line + "\n").encode())
with open(cfg["program"], encoding="utf-8") as handle:
    source = handle.read()
os.unlink(cfg["program"])
workdir = cfg["workdir"]
uid, gid = cfg["uid"], cfg["gid"]
is_root = os.geteuid() == 0
iso = []
libc = None
NEWNS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
if cfg["namespaces"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(source_path, target, fstype, flags, data=None):
        enc = lambda text: None if text is None else text.encode()
        if libc.mount(enc(source_path), enc(target), enc(fstype), flags, enc(data)) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, "mount %s on %s: %s" % (fstype or source_path, target, os.strerror(errno)))
    wanted = NEWNS | NEWNET | NEWPID | NEWIPC
    if is_root and libc.unshare(wanted) == 0:
        iso += ["mount_namespace", "network_namespace", "pid_namespace", "ipc_namespace"]
    elif not is_root and libc.unshare(wanted | NEWUSER) == 0:
        iso += ["user_namespace", "mount_namespace", "network_namespace", "pid_namespace", "ipc_namespace"]
        # Map our own uid/gid to themselves so files we create on tmpfs have an owner.
        real_uid, real_gid = cfg["parent_uid"], cfg["parent_gid"]
        for name, text in (("uid_map", "%d %d 1" % (real_uid, real_uid)), ("setgroups", "deny"),
                           ("gid_map", "%d %d 1" % (real_gid, real_gid))):
            with open("/proc/self/" + name, "w") as handle:
                handle.write(text)
    elif libc.unshare(NEWNET) == 0:
        iso += ["network_namespace"]

def expose_python(prefix):
    # A throwaway uid cannot traverse a 0700 home holding the interpreter (e.g. /root/.pyenv):
    # cover the first closed ancestor with an empty tmpfs and bind the prefix back into it.
    # This also hides the rest of that home directory from the program.
    path, closed = "/", None
    for part in prefix.strip("/").split("/"):
        path = os.path.join(path, part)
        if not os.stat(path).st_mode & 0o001:
            closed = path
            break
    if closed is None:
        return
    stash = "/tmp/.polo-python"
    os.mkdir(stash)
    mount(prefix, stash, None, BIND | REC)
    mount("tmpfs", closed, "tmpfs", NOSUID | NODEV, "size=64k,mode=0755")
    os.makedirs(prefix)
    mount(stash, prefix, None, BIND | REC)
    mount(None, prefix, None, BIND | REMOUNT | RDONLY | NOSUID)
    libc.umount2(stash.encode(), 2)  # MNT_DETACH
    os.rmdir(stash)

def set_up_mounts():
    mount(None, "/", None, REC | PRIVATE)  # nothing below may propagate back to the host
    # Read-only, nosuid view of every mount (mount_setattr with AT_RECURSIVE, Linux >= 5.12).
    attr = (ctypes.c_uint64 * 4)(RDONLY | NOSUID, 0, 0, 0)
    if libc.syscall(442, -100, b"/", 0x8000, ctypes.byref(attr), ctypes.sizeof(attr)) == 0:
        iso.append("read_only_root")
    tmp_options = "size=%d,nr_inodes=4096,mode=1777" % cfg["disk_bytes"]
    mount("tmpfs", "/tmp", "tmpfs", NOSUID | NODEV, tmp_options)
    for shared in ("/var/tmp", "/dev/shm", "/run/lock"):
        if "read_only_root" not in iso and os.path.isdir(shared):
            mount("tmpfs", shared, "tmpfs", NOSUID | NODEV, "size=64k,nr_inodes=64,mode=1777")
    if is_root:
        expose_python(cfg["python_prefix"])
    os.makedirs(workdir, exist_ok=True)  # recreated inside the private /tmp when it lived there
    owner = ",uid=%d,gid=%d" % (uid, gid) if is_root else ""
    mount("tmpfs", workdir, "tmpfs", NOSUID | NODEV,
          "size=%d,nr_inodes=4096,mode=0700%s" % (cfg["disk_bytes"], owner))
    iso.append("private_tmp")
    if "pid_namespace" in iso:
        mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC)
        iso.append("private_proc")

def drop_capabilities():
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    iso.append("capabilities_dropped")

def readable_by_all(prefix):
    path = "/"
    for part in prefix.strip("/").split("/"):
        path = os.path.join(path, part)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True

def set_up_child():
    if "mount_namespace" in iso:
        set_up_mounts()
    os.chdir(workdir)  # again: a tmpfs may now cover the old directory
    if is_root and uid is not None and ("mount_namespace" in iso or readable_by_all(cfg["python_prefix"])):
        if "mount_namespace" not in iso:
            os.chown(workdir, uid, gid)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        iso.append("throwaway_uid")
        if "mount_namespace" in iso:
            iso.append("capabilities_dropped")  # setuid away from 0 clears them
    elif "user_namespace" in iso:
        drop_capabilities()
    if libc is not None and libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
        iso.append("no_new_privs")
    cpu = cfg["cpu_seconds"]
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, cfg["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, cfg["file_size_bytes"]),
                         (resource.RLIMIT_NPROC, cfg["max_processes"]),
                         (resource.RLIMIT_NOFILE, cfg["max_open_files"]),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, value if isinstance(value, tuple) else (value, value))
    # Over-size writes then fail with EFBIG (a readable error) instead of killing silently.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    say("iso " + " ".join(iso))

pid = os.fork()
if pid == 0:
    try:
        set_up_child()
    except BaseException as exc:
        say("setup-error %s: %s" % (type(exc).__name__, exc))
        os._exit(125)
    os.close(status_fd)
    del cfg, libc
    sys.argv = [PROGRAM]
    namespace = {"__name__": "__main__", "__file__": PROGRAM, "__builtins__": __builtins__}
    code = 0
    try:
        exec(compile(source, PROGRAM, "exec"), namespace)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        import traceback  # the first frame is this runner's; the program's own frames follow
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)
say("pid %d" % pid)
_, wait_status = os.waitpid(pid, 0)
if os.WIFSIGNALED(wait_status):
    say("signal %d" % os.WTERMSIG(wait_status))
else:
    say("exit %d" % os.WEXITSTATUS(wait_status))
os._exit(0)
'''.replace("PROGRAM", repr(PROGRAM_FILE))

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


def _kill(process: subprocess.Popen, program_pidfd: int | None) -> None:
    """SIGKILL the program's PID namespace (via its init) and then the whole process group.

    The runner is given a moment to reap the killed program first: once the runner is gone the
    program would be re-parented to the machine's init, which in some containers never reaps.
    """
    if program_pidfd is not None:
        try:
            signal.pidfd_send_signal(program_pidfd, signal.SIGKILL)
        except OSError:
            pass  # already gone
        try:
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Reader:
    """Collects the child's stdout, stderr and status pipe, each capped."""

    def __init__(self, process: subprocess.Popen, status_fd: int, cap: int) -> None:
        self.cap = cap
        self.buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray(),
                        status_fd: bytearray()}
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

    Raises SandboxError only when the sandbox cannot be set up (a bug or an unusual kernel),
    never because of the program.
    """
    limits = SandboxLimits() if limits is None else limits
    workdir, program_path = _write_program(source)
    uid, gid = _throwaway_ids()
    status_read, status_write = os.pipe()
    config = _runner_config(limits, status_write, program_path, workdir, uid, gid)
    started = time.monotonic()
    process = _start_runner(config, workdir, status_read, status_write)
    os.close(status_write)
    reader = _Reader(process, status_read, limits.max_output_bytes)
    deadline = started + limits.timeout_s
    timed_out = False
    program_pidfd = None
    try:
        while reader.open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            reader.pump(min(remaining, 0.5))
            report = _parse_status(reader.status_lines())
            if program_pidfd is None:
                program_pidfd = _open_program_pidfd(report)
            if _should_stop_watching(reader, process, report):
                break
    finally:
        duration = _release(process, reader, program_pidfd, status_read, workdir, started)
    report = _parse_status(reader.status_lines())
    if "setup-error" in report:
        raise SandboxError(f"could not set up the sandbox: {report['setup-error']}")
    return _result(report, reader, timed_out, limits, duration)


def _write_program(source: str) -> tuple[str, str]:
    """Return (a fresh working directory, the path of ``source`` written into it as the program)."""
    workdir = tempfile.mkdtemp(prefix="polo-sandbox-")
    program_path = os.path.join(workdir, PROGRAM_FILE)
    with open(program_path, "w", encoding="utf-8") as handle:
        handle.write(source)
    return workdir, program_path


def _runner_config(
    limits: SandboxLimits, status_fd: int, program_path: str, workdir: str, uid: int | None, gid: int | None
) -> dict:
    """Return the settings the runner script reads from its command line."""
    return {
        "status_fd": status_fd, "program": program_path, "workdir": workdir,
        "uid": uid, "gid": gid, "parent_uid": os.getuid(), "parent_gid": os.getgid(),
        "namespaces": limits.namespaces, "python_prefix": sys.base_prefix,
        "cpu_seconds": limits.cpu_limit, "memory_bytes": limits.memory_bytes,
        "file_size_bytes": limits.file_size_bytes, "max_processes": limits.max_processes,
        "max_open_files": limits.max_open_files, "disk_bytes": limits.disk_bytes,
    }


def _start_runner(config: dict, workdir: str, status_read: int, status_write: int) -> subprocess.Popen:
    """Return the started runner process (on failure, the pipe and working directory are released first)."""
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CHILD, json.dumps(config)],
            cwd=workdir, env=child_environment(workdir), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_write,),
            start_new_session=True, close_fds=True,
        )
    except BaseException:
        os.close(status_read)
        os.close(status_write)
        shutil.rmtree(workdir, ignore_errors=True)
        raise


def _open_program_pidfd(report: dict[str, str]) -> int | None:
    """Return a pidfd for the program once the runner has reported its pid (-1: it is already gone)."""
    if "pid" not in report or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(int(report["pid"]))
    except OSError:
        return -1  # already gone; do not try again


def _should_stop_watching(reader: _Reader, process: subprocess.Popen, report: dict[str, str]) -> bool:
    """Return whether the run is over: finished, failed to set up, over the output cap, or its runner killed."""
    if reader.over_cap or "setup-error" in report:
        return True
    reported = "exit" in report or "signal" in report
    if reader.status_fd not in reader.open_fds and process.poll() is not None and not reported:
        return True  # the runner was killed (by the program) before it could report
    if reported and reader.status_fd not in reader.open_fds:
        # Finished: take what is already in the pipes, without waiting for stragglers
        # (a daemonised grandchild may hold them open).
        reader.pump(0)
        return True
    return False


def _release(
    process: subprocess.Popen, reader: _Reader, program_pidfd: int | None, status_read: int, workdir: str, started: float
) -> float:
    """Return the run's duration in seconds, after killing what is left of it and releasing its pipes and files."""
    _kill(process, program_pidfd if program_pidfd not in (None, -1) else None)
    process.wait()
    duration = time.monotonic() - started
    if program_pidfd not in (None, -1):
        os.close(program_pidfd)
    reader.close()
    process.stdout.close()
    process.stderr.close()
    os.close(status_read)
    shutil.rmtree(workdir, ignore_errors=True)
    return duration


def _result(report: dict[str, str], reader: _Reader, timed_out: bool, limits: SandboxLimits, duration: float) -> SandboxResult:
    """Return the `SandboxResult` of a finished run (logging the isolation the first time)."""
    stdout = bytes(reader.buffers[reader.stdout_fd])
    stderr = bytes(reader.buffers[reader.stderr_fd])
    status, reason, returncode, signal_number = _classify(
        report, timed_out, reader.over_cap, limits, stderr
    )
    isolation = Isolation.from_words(report.get("iso", "").split())
    _log_isolation_once(isolation)
    return SandboxResult(status, reason, returncode, signal_number, stdout, stderr, duration, isolation)


def _log_isolation_once(isolation: Isolation) -> None:
    """Log the isolation in force the first time a program runs in this process."""
    global _isolation_logged
    if _isolation_logged:
        return
    _isolation_logged = True
    level = logging.INFO if isolation.network_namespace and isolation.pid_namespace else logging.WARNING
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
    "run_python",
]
