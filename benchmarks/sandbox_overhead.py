"""Sandbox overhead per program: wall time of run_python on a trivial program.

Prints the isolation in force, then the median over N runs in milliseconds as the last line.
With ``--against FILE`` it also loads another version of the runner module from FILE (e.g.
``git show HEAD~1:src/polo/sandbox/runner.py > /tmp/old_runner.py``) and times the two in
alternation in the same run, so that the load of a shared machine falls on both alike. A runner.py
from after the runner's in-sandbox half moved to polo/sandbox/child.py runs with this checkout's
child.py, so such a comparison times runner.py's changes only.

With ``--user UID`` (run as root) it also times the sandbox of a normal user (a user namespace
instead of a throwaway uid), in alternation with root's: a worker process running as UID (its own
group, no others, a fresh home and TMPDIR) times one program whenever asked. The worker runs this
script's interpreter, or ``--python PATH``; that uid must be able to run it and import polo from it
(a venv of /usr/bin/python3 whose .pth adds this checkout's site-packages will do, where this
interpreter lies under /root). Run the whole benchmark with that interpreter to compare like with like.

Usage: python benchmarks/sandbox_overhead.py [N] [--against FILE] [--user UID [--python PATH]]   (N defaults to 50)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from types import ModuleType

from polo.sandbox import runner


def load_runner(path: str) -> ModuleType:
    """Return the runner module at ``path`` (another version of polo.sandbox.runner)."""
    spec = importlib.util.spec_from_file_location("other_runner", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def one_run_ms(module: ModuleType) -> float:
    """Return the wall time in ms of one sandboxed ``pass`` through ``module``."""
    started = time.perf_counter()
    result = module.run_python("pass", module.SandboxLimits())
    elapsed = (time.perf_counter() - started) * 1000
    assert result.ok, result.reason
    return elapsed


def bare_python_ms(runs: int = 10) -> float:
    """Return the median wall time in ms of starting the interpreter with nothing around it."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def worker() -> None:
    """Time one sandboxed program per line read from stdin (the ``--user`` side), printing the ms."""
    isolation = runner.run_python("pass", runner.SandboxLimits()).isolation  # also the warm-up
    print(f"uid {os.geteuid()}, python {sys.executable}: isolation {isolation.summary()}", flush=True)
    for _ in sys.stdin:
        print(f"{one_run_ms(runner):.3f}", flush=True)


class UserWorker:
    """A worker process running as another uid, which times a program when asked."""

    def __init__(self, uid: int, python: str) -> None:
        self.home = tempfile.mkdtemp(prefix="polo-bench-")
        os.chmod(self.home, 0o755)
        os.chown(self.home, uid, uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": self.home, "TMPDIR": self.home, "LANG": "C.UTF-8"}
        self.process = subprocess.Popen(
            [python, os.path.abspath(__file__), "--worker"],
            env=env,
            cwd=self.home,
            user=uid,
            group=uid,
            extra_groups=[],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.summary = self.process.stdout.readline().strip()
        if not self.summary:
            raise SystemExit(f"the worker as uid {uid} ({python}) did not start; see its error above")

    def one_run_ms(self) -> float:
        """Return the worker's wall time in ms for one sandboxed ``pass``."""
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        """Stop the worker and remove its home."""
        self.process.stdin.close()
        self.process.wait()
        shutil.rmtree(self.home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="?", type=int, default=50)
    parser.add_argument("--against", help="another runner.py to time alongside, in alternation")
    parser.add_argument("--user", type=int, help="also time the sandbox as this uid (a normal user), in alternation")
    parser.add_argument("--python", help="the interpreter of the --user worker (default: this one)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    if args.user is not None and os.geteuid() != 0:
        parser.error("--user needs root (to start a process as another uid)")
    print(f"uid {os.geteuid()}, python {sys.executable} ({sys.version.split()[0]})")
    modules = {"this": runner}
    if args.against:
        modules["against"] = load_runner(args.against)
    for name, module in modules.items():
        isolation = module.run_python("pass", module.SandboxLimits()).isolation  # also the warm-up
        print(f"{name}: isolation {isolation.summary()}")
    timers = {name: (lambda module=module: one_run_ms(module)) for name, module in modules.items()}
    user = None
    if args.user is not None:
        user = UserWorker(args.user, args.python or sys.executable)
        print(f"user: {user.summary}")
        timers["user"] = user.one_run_ms
    print(f"bare `python -I -S -c pass` median over 10: {bare_python_ms():.1f} ms")
    times: dict[str, list[float]] = {name: [] for name in timers}
    try:
        for _ in range(args.runs):
            for name, timer in timers.items():
                times[name].append(timer())
    finally:
        if user is not None:
            user.close()
    for name in reversed(list(timers)):
        found = times[name]
        print(
            f"{name}: runs {len(found)}, min {min(found):.1f} ms, max {max(found):.1f} ms, "
            f"median {statistics.median(found):.1f} ms"
        )
    print(f"median sandbox overhead per program: {statistics.median(times['this']):.1f} ms")


if __name__ == "__main__":
    main()
