"""How fast this CPU multiplies in fp32 and in bf16, measured once and cached: what `precision: auto` is decided by.

A CPU's flags say what it could do, not what its kernels do: an Intel VM that lists
`avx512_bf16` without AMX ran bf16 matmuls at about half its fp32 rate (issue 28: 167 against
320 GFLOP/s at SmolLM2-135M's own shapes), while an AMD EPYC with AVX-512 BF16 runs bf16 about
three times faster than fp32. So where the flags allow bf16, polo times both dtypes at a
language model's matmul shapes and picks the faster. The answer is cached under
`$POLO_CACHE/matmul_rates.json`, keyed by CPU model, thread count and torch version, so a
machine measures once (well under a second) and every command after that reads it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# (rows, inner, columns) of the matmuls that dominate a small causal LM's step, at SmolLM2-135M's
# sizes: the MLP's up and down projections and a slice of the LM head, over 1,024 token rows.
MODEL_SHAPES = ((1024, 576, 1536), (1024, 1536, 576), (256, 576, 8192))
REPEATS = 3


@dataclass(frozen=True)
class MatmulRates:
    """Measured matmul throughput on this CPU in GFLOP/s, per dtype (the median over `MODEL_SHAPES`)."""

    fp32: float
    bf16: float
    cached: bool = False

    @property
    def bf16_faster(self) -> bool:
        """Return True when bf16 matmuls ran faster than fp32 ones."""
        return self.bf16 > self.fp32

    def describe(self) -> str:
        """Return the rates as a banner prints them, e.g. "fp32 310 / bf16 870 GFLOP/s (measured)"."""
        source = "cached" if self.cached else "measured"
        return f"fp32 {self.fp32:.0f} / bf16 {self.bf16:.0f} GFLOP/s ({source})"


def cpu_model() -> str:
    """Return the CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key() -> str:
    """Return what a cached measurement is valid for: CPU model, torch threads, torch version and shapes."""
    return f"{cpu_model()} | threads {torch.get_num_threads()} | torch {torch.__version__} | shapes {MODEL_SHAPES}"


def cache_path() -> Path:
    """Return the cache file (`$POLO_CACHE/matmul_rates.json`, else `~/.cache/polo/matmul_rates.json`)."""
    return Path(os.environ.get("POLO_CACHE", Path.home() / ".cache" / "polo")).expanduser() / "matmul_rates.json"


def time_matmuls(dtypes=(torch.float32, torch.bfloat16), shapes=MODEL_SHAPES, repeats: int = REPEATS) -> list[float]:
    """Return, per dtype, the median rate in GFLOP/s of `a @ b` over `shapes` (best of `repeats` each, after a warm-up).

    The dtypes take turns on every shape, so a load that comes and goes on a shared machine
    slows both alike and the comparison between them holds.
    """
    rates: list[list[float]] = [[] for _ in dtypes]
    generator = torch.Generator(device=torch.device("cpu")).manual_seed(0)
    for rows, inner, columns in shapes:
        a = torch.randn(rows, inner, generator=generator, device=torch.device("cpu"))
        b = torch.randn(inner, columns, generator=generator, device=torch.device("cpu"))
        pairs = [(a.to(dtype), b.to(dtype)) for dtype in dtypes]
        best = [float("inf")] * len(dtypes)
        for repeat in range(repeats + 1):  # the first round warms up: oneDNN picks and caches its kernel then
            for index, (left, right) in enumerate(pairs):
                start = time.perf_counter()
                left @ right
                if repeat:
                    best[index] = min(best[index], time.perf_counter() - start)
        for index, seconds in enumerate(best):
            rates[index].append(2.0 * rows * inner * columns / seconds / 1e9)
    return [sorted(values)[len(values) // 2] for values in rates]


def measure_rates() -> MatmulRates:
    """Return freshly measured fp32 and bf16 matmul rates of this CPU (a fraction of a second)."""
    with torch.no_grad():
        fp32, bf16 = time_matmuls()
    return MatmulRates(fp32=fp32, bf16=bf16)


def cached_rates(measure=measure_rates) -> MatmulRates:
    """Return this machine's rates from the cache, measuring (and caching) them when the key is new.

    A cache that cannot be read or written costs a measurement, never a failure.
    """
    path, key = cache_path(), cache_key()
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entry = entries.get(key) if isinstance(entries, dict) else None
    if isinstance(entry, dict) and {"fp32", "bf16"} <= entry.keys():
        return MatmulRates(float(entry["fp32"]), float(entry["bf16"]), cached=True)
    rates = measure()
    entries = entries if isinstance(entries, dict) else {}
    entries[key] = {name: value for name, value in asdict(rates).items() if name != "cached"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(entries, indent=1))
        temporary.replace(path)  # whole or not at all: a concurrent reader never sees half a file
    except OSError:
        pass
    return rates
