"""Helpers shared by the benchmark scripts: matmul rate, medians, peak RSS, other processes' CPU load."""

from __future__ import annotations

import datetime
import functools
import json
import os
import resource
import shlex
import statistics
import subprocess
import time
from pathlib import Path

import torch

# The overrides that make `polo train` a timed run and nothing else: no evaluation, checkpoints, plots,
# trackers or progress bar.
TIMED_RUN_OVERRIDES = [
    "eval.before=false",
    "eval.after=false",
    "output.save_every=0",
    "output.plots=false",
    "output.report_to=[]",
    "output.progress=false",
]


def matmul_rate(dtype: torch.dtype, size: int = 2048, reps: int = 20, warmup: int = 5, packed: bool = False) -> float:
    """Return the best measured rate (FLOP/s) of one `size`x`size` @ `size`x`size` matmul in `dtype` on the CPU.

    `packed`: through oneDNN with the right-hand matrix packed once (polo.runtime.rates.packed_linear, what
    polo's sampler uses where it measured faster), 0 where this torch cannot; else `torch.matmul`, which
    multiplies fp32 with MKL's sgemm in torch's CPU wheels.
    """
    from polo.runtime.rates import pack_linear_weight, packed_linear

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    multiply = functools.partial(torch.matmul, a, b)
    if packed:
        weight = pack_linear_weight(b.t().contiguous(), size)
        if weight is None:
            return 0.0
        multiply = functools.partial(packed_linear, a, packed=weight)
    for _ in range(warmup):
        multiply()
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        multiply()
        best = min(best, time.perf_counter() - started)
    return 2.0 * size**3 / best


def peak_rss_bytes() -> int:
    """Return this process's peak resident set size so far, in bytes (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


# ----------------------------------------------------------------------------------------------
# Other processes on the machine. On a small CPU box a second busy process (a test run, another
# benchmark) can slow these measurements by an order of magnitude, so the scripts wait for the
# machine to be quiet before measuring and report how much CPU others used while they measured.

_TICKS = os.sysconf("SC_CLK_TCK")


def system_busy_seconds() -> float:
    """Return CPU-seconds all processes have spent busy since boot (from /proc/stat; 0 if unavailable)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICKS


def own_cpu_seconds(include_children: bool = False) -> float:
    """Return CPU-seconds used by this process (and, optionally, its finished children)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds = usage.ru_utime + usage.ru_stime
    if include_children:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds += children.ru_utime + children.ru_stime
    return seconds


class ForeignLoad:
    """Measures the CPU (in cores) used by other processes between `start()` and `cores()`."""

    def __init__(self, include_children: bool = False):
        self.include_children = include_children
        self.start()

    def start(self) -> None:
        self.wall = time.perf_counter()
        self.busy = system_busy_seconds()
        self.own = own_cpu_seconds(self.include_children)

    def cores(self) -> float:
        wall = max(time.perf_counter() - self.wall, 1e-9)
        other = (system_busy_seconds() - self.busy) - (own_cpu_seconds(self.include_children) - self.own)
        return max(other, 0.0) / wall


def _log(message: str) -> None:
    print(message, flush=True)


def wait_for_quiet(max_wait: float, threshold: float = 0.2, window: float = 5.0, log=_log) -> float:
    """Wait (up to `max_wait` s) until other processes use under `threshold` cores; return the last reading."""
    deadline = time.perf_counter() + max_wait
    warned = False
    while True:
        monitor = ForeignLoad(include_children=True)
        time.sleep(window)
        load = monitor.cores()
        if load < threshold:
            return load
        if time.perf_counter() >= deadline:
            log(f"WARNING: other processes still use {load:.1f} CPU cores; measuring anyway (timings will be inflated)")
            return load
        if not warned:
            log(f"waiting for the machine to be quiet: other processes use {load:.1f} CPU cores ...")
            warned = True


def measure_quietly(measure, max_wait: float, attempts: int = 5, threshold: float = 0.2, log=_log):
    """Return `(result, other_cores)` of `measure()`, redoing it (after waiting) while other processes were busy."""
    for attempt in range(attempts):
        monitor = ForeignLoad()
        result = measure()
        others = monitor.cores()
        if others < threshold or attempt == attempts - 1:
            return result, others
        log(f"  (other processes used {others:.2f} CPU cores during that measurement; waiting, then redoing it)")
        wait_for_quiet(max_wait, threshold, log=log)


def copy_rate(mebibytes: int = 400, reps: int = 8) -> float:
    """Return the best measured rate (bytes/s, read plus written) of copying a `mebibytes` MiB fp32 tensor into another.

    A stand-in for the memory bandwidth a step's weight and activation traffic gets. A shared VM's neighbours can
    take bandwidth while a 2048^3 matmul, which runs from its caches, hardly notices; printed beside the matmul
    rates, it shows which kind of slowdown a run saw.
    """
    source = torch.ones(mebibytes * 2**20 // 4, device="cpu")  # host memory is what it measures
    target = torch.empty_like(source)
    target.copy_(source)  # the first touch of the target's pages is not part of the rate
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return 2.0 * source.numel() * source.element_size() / best


def matmul_rates(max_wait: float) -> tuple[float, float, float]:
    """Return the measured (bf16, fp32, oneDNN-packed fp32) 2048^3 matmul rates in FLOP/s, taken while the machine is
    quiet. On a 2-core AMD EPYC torch's fp32 matmul (MKL) ran at ~215 GFLOP/s and oneDNN's packed one at ~450."""
    wait_for_quiet(max_wait)
    (bf16, fp32, packed), _ = measure_quietly(
        lambda: (matmul_rate(torch.bfloat16), matmul_rate(torch.float32), matmul_rate(torch.float32, packed=True)),
        max_wait,
    )
    return bf16, fp32, packed


def parameter_count(model: str) -> int:
    """Return N, the number of distinct parameters of `model` (a built-in name or a path; tied embeddings counted
    once), read from its config alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from polo.models.loading import resolve_model_path

    config = AutoConfig.from_pretrained(str(resolve_model_path(model)))
    with torch.device("meta"):  # shapes only: nothing is allocated or read
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


RESULTS = Path(__file__).resolve().parent / "results"


def machine_name(device: str = "cpu") -> str:
    """Return the machine a figure was measured on: the GPU's name, or the CPU's model, cores and bf16 support."""
    from polo.runtime.rates import cpu_model, native_bf16

    if device != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({cpu_model()} host)"
    bf16 = "native bf16" if native_bf16() else "no native bf16"
    return f"{cpu_model()}, {os.cpu_count()} cores, {bf16}"


def source_commit() -> str:
    """Return the short commit of the tree that ran, "+changes" when it had uncommitted ones ("unknown" outside git)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}+changes" if changed else commit


def record_result(benchmark: str, figures: dict, argv: list[str], device: str = "cpu") -> Path:
    """Append one run's figures to `benchmarks/results/<benchmark>.jsonl`, with its date, commit, machine and command:
    what `benchmarks/report.py` writes docs/benchmarks.md from. Return the file."""
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": source_commit(),
        "machine": machine_name(device),
        "command": shlex.join(["python", f"benchmarks/{benchmark}.py", *argv]),
        "figures": figures,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{benchmark}.jsonl"
    with path.open("a") as results:
        results.write(json.dumps(record) + "\n")
    return path
