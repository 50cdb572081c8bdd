"""Sandbox overhead per program: wall time of run_python on a trivial program.

Prints the isolation in force, then the median over N runs in milliseconds as the last line.
Usage: python benchmarks/sandbox_overhead.py [N]   (default 50)
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from polo.sandbox.runner import SandboxLimits, run_python


def measure(runs: int, limits: SandboxLimits) -> list[float]:
    """Return the wall time in ms of ``runs`` sandboxed runs of ``pass``."""
    run_python("pass", limits)  # warm-up: page cache, first log line
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        result = run_python("pass", limits)
        times.append((time.perf_counter() - started) * 1000)
        assert result.ok, result.reason
    return times


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    limits = SandboxLimits()
    isolation = run_python("pass", limits).isolation
    print(f"isolation {isolation.summary()}")
    bare = []
    for _ in range(10):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
        bare.append((time.perf_counter() - started) * 1000)
    print(f"bare `python -I -S -c pass` median over 10: {statistics.median(bare):.1f} ms")
    times = measure(runs, limits)
    print(f"sandboxed runs: {runs}, min {min(times):.1f} ms, max {max(times):.1f} ms")
    print(f"median sandbox overhead per program: {statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
