"""The syscall filter every sandboxed program runs under (compiled with libseccomp, loaded by bwrap).

The filter allows by default and denies a list: a Python program needs hundreds of syscalls
whose set changes with the interpreter and libc, so an allow-list would break programs in
ways a test suite would not see; what is denied is every syscall that reaches outside the
sandbox or opens a large kernel attack surface. Denied calls fail with ``EPERM`` (``ENOSYS``
for ``clone3``, so that libc falls back to ``clone``, whose flags the filter can read).
Syscalls of any other ABI (x32, or i386 through ``int 0x80``) kill the process: the filter is
written for the native one only.
"""

from __future__ import annotations

import errno
import functools
import os
import socket

# Reach outside the sandbox, or large kernel surfaces a test program never needs.
DENIED = (
    "socket",
    "connect",
    "bind",
    "listen",
    "accept",
    "accept4",
    "unshare",
    "setns",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "process_madvise",
    "kcmp",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "name_to_handle_at",
    "open_by_handle_at",
    "fanotify_init",
    "lookup_dcookie",
    "swapon",
    "swapoff",
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "acct",
    "quotactl",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    # System V shared memory and message queues outlive the process that fills them (until the
    # IPC namespace goes, at the end of the run), outside RLIMIT_AS: 4 x 100 MiB segments were kept
    # under a 256 MiB limit. Nothing in the standard library uses them.
    "shmget",
    "msgget",
)
# Any one of these in clone's flags makes a new namespace (CLONE_NEWTIME shares its bit with the
# exit signal in clone's first argument, and is only reachable through clone3/unshare anyway).
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


class SeccompUnavailable(RuntimeError):
    """pyseccomp or the system's libseccomp cannot build the filter here."""


def _new_filter():
    """Return an empty allow-by-default pyseccomp filter that kills foreign-ABI syscalls."""
    try:
        import pyseccomp
    except (ImportError, OSError, AttributeError) as exc:  # the latter two: no libseccomp.so.2
        raise SeccompUnavailable(f"pyseccomp cannot load libseccomp ({exc}); install libseccomp2") from exc
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    rules.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.KILL_PROCESS)
    return pyseccomp, rules


@functools.lru_cache(maxsize=1)
def compiled_filter() -> bytes:
    """Return the filter as a classic BPF program, the form ``bwrap --seccomp FD`` reads."""
    pyseccomp, rules = _new_filter()
    deny = pyseccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            rules.add_rule(deny, name)
        except (OSError, ValueError, RuntimeError):
            continue  # a syscall this libseccomp or architecture does not know cannot be called either
    # socketpair(AF_UNIX) reaches nothing outside the pair and asyncio needs it for its wake-up pipe.
    rules.add_rule(deny, "socketpair", pyseccomp.Arg(0, pyseccomp.NE, socket.AF_UNIX))
    for flag in NAMESPACE_FLAGS:
        rules.add_rule(deny, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    with os.fdopen(os.memfd_create("polo-seccomp"), "w+b") as program:
        rules.export_bpf(program)
        program.seek(0)
        return program.read()


__all__ = ["DENIED", "NAMESPACE_FLAGS", "SeccompUnavailable", "compiled_filter"]
