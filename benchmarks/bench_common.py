"""Helpers shared by the benchmark scripts: matmul rate, medians, peak RSS, formatting."""

from __future__ import annotations

import resource
import statistics
import time

import torch


def matmul_rate(dtype: torch.dtype, size: int = 2048, reps: int = 10, warmup: int = 3) -> float:
    """Return the best measured rate (FLOP/s) of one `size`x`size` @ `size`x`size` matmul in `dtype` on the CPU."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    for _ in range(warmup):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - started)
    return 2.0 * size**3 / best


def peak_rss_bytes() -> int:
    """Return this process's peak resident set size so far, in bytes (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"
