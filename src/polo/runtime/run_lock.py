"""One owner per run directory: an OS lock taken before a command checks or writes anything there.

Every command that writes a run directory (`polo train`, `sft`, `rm`, `dpo`, `pipeline` and each
of its stages, `control`, `eval -o` into a run) holds an exclusive `fcntl.flock` on
`<dir>/.polo.lock` for as long as it runs. The file says who holds it (pid, host, start time,
command) so that a second command can say whom it is waiting for. The kernel drops the lock when
the holding process dies, however it dies: a SIGKILLed or crashed run never leaves a lock that
blocks the next one, and a lock file left behind by a crash is just text.

The lock file is not part of a run (`polo.runtime.checkpoint.RUN_FILES` does not name it), so it
never makes a directory look used and `output.overwrite=true` never removes it. Under `torchrun`
only rank 0 locks; the other ranks wait for its verdict and all refuse alike.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from polo.config import ConfigError
from polo.runtime import parallel
from polo.runtime.checkpoint import previous_run

LOCK_FILE = ".polo.lock"
_HELD_HERE: set[Path] = set()  # directories this process holds through `owned_run_dir`


class RunDirLockedError(ConfigError):
    """Another live process holds the run directory; this command touched nothing there."""


class RunDirUnwritableError(ConfigError):
    """The run directory, or the folder it would be made in, cannot be written; nothing was written there."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run directory: what its lock file says."""

    pid: str = "unknown"
    host: str = "unknown"
    started: str = "unknown"
    command: str = ""

    @classmethod
    def current(cls) -> LockHolder:
        """Return this process as a holder: its pid, host name, the time now and its command line."""
        command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python"
        return cls(
            str(os.getpid()), socket.gethostname(), datetime.now().astimezone().isoformat(timespec="seconds"), command
        )

    @classmethod
    def parse(cls, text: str) -> LockHolder:
        """Return the holder a lock file's text names (fields it lacks stay "unknown")."""
        fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
        return cls(**{name: fields[name] for name in ("pid", "host", "started", "command") if fields.get(name)})

    def text(self) -> str:
        """Return the lock file's text: one `field: value` line per field."""
        return f"pid: {self.pid}\nhost: {self.host}\nstarted: {self.started}\ncommand: {self.command}\n"


def _read_holder(path: Path) -> LockHolder:
    """Return the holder written in `path`, waiting a moment for a holder that has locked but not yet written it."""
    holder = LockHolder()
    for _ in range(20):
        with suppress(OSError):
            holder = LockHolder.parse(path.read_text())
        if holder.pid != "unknown":
            break
        time.sleep(0.05)
    return holder


def refusal(directory: Path, what: str, holder: LockHolder, instead: str = "") -> str:
    """Return the one-line refusal for a run directory that `holder` holds; `instead` is the other way out
    (default: another `what`)."""
    command = f", {holder.command!r}" if holder.command else ""
    return (
        f"{what} {directory} is in use by another polo run "
        f"(pid {holder.pid} on {holder.host}{command}, started {holder.started}): "
        f"wait for it to finish, or {instead or f'pick another {what}'}"
    )


def is_run_dir(directory: Path | str) -> bool:
    """Return True when `directory` holds a run (an earlier run's files, or a lock file)."""
    directory = Path(directory)
    return (directory / LOCK_FILE).exists() or bool(previous_run(directory))


class RunDirLock:
    """An exclusive lock on `<directory>/.polo.lock`, held by this process from `acquire` until `release` or its
    death."""

    def __init__(self, directory: Path | str, what: str = "output.dir", instead: str = ""):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.what, self.instead = (
            what,
            instead,
        )  # how the user named the directory (output.dir, pipeline.dir), and the way out
        self.fd: int | None = None
        self.created_directory = False

    def acquire(self) -> RunDirLock:
        """Take the lock and write this process into the lock file; return self.

        Raises `RunDirLockedError` (one line naming the holder) when another process holds it.
        """
        self.created_directory = not self.directory.exists()
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirLockedError(
                    refusal(self.directory, self.what, _read_holder(self.path), self.instead)
                ) from None
            except OSError as error:  # a file system without locks (some network or FUSE mounts): run, but say so
                os.close(fd)
                print(
                    f"polo: warning: cannot lock {self.path} ({error.strerror}); a second run on {self.directory} "
                    "would not be stopped",
                    file=sys.stderr,
                    flush=True,
                )
                return self
            if self._still_linked(fd):
                break
            os.close(fd)  # the holder before us removed the file as it let go: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, LockHolder.current().text().encode())
        self.fd = fd
        return self

    def _open(self) -> int:
        """Return a descriptor of the lock file, made with its directory where missing.

        Raises `RunDirUnwritableError` (one line) where either cannot be made: a read-only file
        system, a parent this user may not write, a name already taken by a file.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            named = Path(error.filename) if error.filename else None
            where = f": {named}" if named is not None and named not in (self.path, self.directory) else ""
            raise RunDirUnwritableError(
                f"{self.what} {self.directory} cannot be written ({error.strerror or error}{where}): "
                f"{self.instead or f'pick another {self.what}'}"
            ) from None

    def _still_linked(self, fd: int) -> bool:
        """Return True when `fd` is still the file at `self.path` (a releasing holder unlinks it before unlocking)."""
        try:
            here, there = os.fstat(fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def release(self) -> None:
        """Remove the lock file and let go of the lock; remove the directory too when this lock made it and it stayed
        empty."""
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: a waiter that opened it sees it gone and retries
        finally:
            os.close(self.fd)
            self.fd = None
        if self.created_directory:
            with suppress(OSError):
                self.directory.rmdir()  # a refused config or model leaves no empty directory behind


@contextmanager
def owned_run_dir(directory: Path | str, what: str = "output.dir", instead: str = "") -> Iterator[None]:
    """Hold the lock on run directory `directory` for the duration; raise `RunDirLockedError` when another run holds it.

    Under `torchrun` rank 0 takes the lock and every rank raises the same error when it could
    not; without a process group, a rank other than 0 (RANK) leaves locking to rank 0. A
    directory this process already holds this way is held again at no cost (a pipeline holds a
    stage's directory, then the stage's own run does).
    """
    key = Path(directory).resolve()
    if key in _HELD_HERE:
        yield
        return
    lock, refused = RunDirLock(directory, what, instead), None
    takes_lock = parallel.rank() == 0 and (parallel.is_distributed() or os.environ.get("RANK", "0") == "0")
    if takes_lock:
        try:
            lock.acquire()
        except RunDirLockedError as error:
            refused = str(error)
    verdict = parallel.gather_objects(refused)[0]  # every rank waits for rank 0's
    if verdict is not None:
        raise RunDirLockedError(verdict)
    _HELD_HERE.add(key)
    try:
        yield
    finally:
        _HELD_HERE.discard(key)
        lock.release()
