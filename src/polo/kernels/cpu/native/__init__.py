"""polo's native CPU kernels: C++ compiled on first use, or None where that cannot happen.

torch's CPU build runs a decode step's small ops one dispatch at a time, each reading and writing
its tensors afresh; no maintained library ships fused CPU kernels for this torch (the Intel
extension stops at torch 2.8). The few that polo needs are written here in C++ against ATen's
vector types and compiled once per machine with `torch.utils.cpp_extension`, into
`$POLO_CACHE/native/<key>` (`~/.cache/polo` by default), keyed by the sources, torch's version and
the CPU's vector width. The first build takes 15-30 s and prints one line; later
runs load the library in milliseconds.

`native_ops()` returns `torch.ops.polo_native`, or None (once, with one line saying why) when there
is no compiler, the CPU has no AVX2, or `POLO_NATIVE=0` turns them off. Every caller keeps its
torch path for None, and tests compare the two.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

__all__ = ["native_ops", "build_directory"]

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # included by the sources: part of the build key

# The compiler flags of each vector width torch's own CPU kernels are built for (ATen's CPU_CAPABILITY):
# the same ISA, so ATen's Vectorized types take their AVX-512 / AVX2 forms, not the scalar fallback.
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def capability() -> str:
    """Return the vector width torch's CPU kernels use on this machine (AVX512, AVX2, DEFAULT, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def build_directory() -> Path:
    """Return where this machine's build lives: `$POLO_CACHE/native/<sources, torch, capability>`."""
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + source.read_bytes())
    digest.update(f"{torch.__version__} {capability()} {sys.version_info[:2]}".encode())
    root = Path(os.environ.get("POLO_CACHE", Path.home() / ".cache" / "polo")).expanduser()
    return root / "native" / digest.hexdigest()[:16]


def wanted() -> bool:
    """Return whether `POLO_NATIVE` (unset, 1 or 0) asks for the native kernels; another value gets one line on
    stderr and counts as unset."""
    value = os.environ.get("POLO_NATIVE", "1").strip()
    if value not in ("0", "1"):
        print(f"polo: POLO_NATIVE={value!r} is neither 0 nor 1; native CPU kernels stay on", file=sys.stderr)
    return value != "0"


@functools.cache
def native_ops():
    """Return `torch.ops.polo_native` (built or loaded once per process), or None with one line on stderr saying why."""
    if not wanted():
        return None
    flags = CAPABILITY_FLAGS.get(capability())
    if flags is None:
        return _unavailable(f"torch runs this CPU's kernels at {capability()}, without AVX2")
    directory = build_directory()
    use_ninja_wheel()
    try:
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory):
            if not any(directory.glob("*.so")):
                print(
                    f"polo: compiling native CPU kernels once, into {directory} (about 15-30 s)",
                    file=sys.stderr,
                    flush=True,
                )
            cpp_extension.load(
                name="polo_native",
                sources=[str(source) for source in SOURCES],
                extra_cflags=[
                    "-O3",
                    "-fopenmp",
                    f"-DCPU_CAPABILITY={capability()}",
                    f"-DCPU_CAPABILITY_{capability()}",
                ]
                + flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:  # no compiler, no ninja, a failed build: polo runs on torch's ops instead
        lines = f"{error}\n{error.__cause__ or ''}".strip().splitlines()
        errors = [line for line in lines if "error:" in line]  # the compiler's first complaint, else the last line
        return _unavailable((errors or lines[-1:] or [type(error).__name__])[0].strip())
    return torch.ops.polo_native


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold an exclusive lock on `directory`'s build for the block, clearing a killed build's leftover torch lock.

    torch's own build lock is a file made with O_EXCL and removed when the build ends: a build killed
    mid-way (a timeout, SIGKILL) leaves it, and every later process waits on it forever. An `flock`
    is released by the kernel when its holder dies, so while polo holds one no other polo process is
    building here, and a torch lock file still present can only be such a leftover.
    """
    with open(directory / "polo.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def use_ninja_wheel() -> None:
    """Put the `ninja` wheel's binary (a polo dependency) on PATH when no other ninja is there: torch's extension
    builder runs `ninja` by name, and a venv's bin/ is not on PATH when its python is called directly (`make`)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join(filter(None, (ninja.BIN_DIR, os.environ.get("PATH"))))


def _unavailable(reason: str) -> None:
    print(f"polo: native CPU kernels unavailable ({reason}); using torch's ops", file=sys.stderr, flush=True)
    return None
