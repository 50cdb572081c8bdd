"""Sandbox overhead per program: wall time of run_python on a trivial program.

Prints the isolation in force, then the median over N runs in milliseconds as the last line.
With ``--against FILE`` it also loads another version of the runner module from FILE (e.g.
``git show HEAD~1:src/polo/sandbox/runner.py > /tmp/old_runner.py``) and times the two in
alternation in the same run, so that the load of a shared machine falls on both alike.

Usage: python benchmarks/sandbox_overhead.py [N] [--against FILE]   (N defaults to 50)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="?", type=int, default=50)
    parser.add_argument("--against", help="another runner.py to time alongside, in alternation")
    args = parser.parse_args()
    modules = {"this": runner}
    if args.against:
        modules["against"] = load_runner(args.against)
    for name, module in modules.items():
        isolation = module.run_python("pass", module.SandboxLimits()).isolation  # also the warm-up
        print(f"{name}: isolation {isolation.summary()}")
    print(f"bare `python -I -S -c pass` median over 10: {bare_python_ms():.1f} ms")
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(args.runs):
        for name, module in modules.items():
            times[name].append(one_run_ms(module))
    for name in reversed(list(modules)):
        found = times[name]
        print(f"{name}: runs {len(found)}, min {min(found):.1f} ms, max {max(found):.1f} ms, "
              f"median {statistics.median(found):.1f} ms")
    print(f"median sandbox overhead per program: {statistics.median(times['this']):.1f} ms")


if __name__ == "__main__":
    main()
