"""How fast this CPU multiplies in fp32 and in bf16, measured once and cached: what `precision: auto` is decided by.

A CPU's flags say what it could do, not what its kernels do: a VM that lists
`avx512_bf16` without AMX ran bf16 matmuls at about half its fp32 rate (167 against 320 GFLOP/s
at SmolLM2-135M's own shapes), while another CPU with AVX-512 BF16 ran bf16 about three times
faster than fp32. So where the flags allow bf16, polo times both dtypes at a
language model's matmul shapes and picks the faster. The answer is cached under
`$POLO_CACHE/matmul_rates.json`, keyed by the CPU (model, family, stepping, flags), thread count, torch
version and any environment variable that changes the kernels (`cache_key`), so a machine measures once
(well under a second) and every command after that reads it.
"""

from __future__ import annotations

import functools
import hashlib
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
    fp32_packed: float = 0.0  # fp32 through oneDNN with the weight packed once (0: this torch cannot)

    @property
    def bf16_faster(self) -> bool:
        """Return True when bf16 matmuls ran faster than fp32 ones."""
        return self.bf16 > self.fp32

    @property
    def packed_fp32_faster(self) -> bool:
        """Return True when fp32 matmuls ran faster through oneDNN with prepacked weights than through torch's own
        fp32 matmul (MKL's sgemm in torch's CPU wheels)."""
        return self.fp32_packed > self.fp32

    def describe(self) -> str:
        """Return the rates as a banner prints them, e.g. "fp32 310 / bf16 870 GFLOP/s (measured)"."""
        source = "cached" if self.cached else "measured"
        return f"fp32 {self.fp32:.0f} / bf16 {self.bf16:.0f} GFLOP/s ({source})"


# Environment variables that change which matmul kernels run, so a measurement taken without them does
# not hold with them. ONEDNN_MAX_CPU_ISA=AVX512_CORE, for one, keeps oneDNN off the AVX-512 BF16
# instructions: on a CPU whose bf16 matmuls otherwise ran at ~950 GFLOP/s (fp32 ~210), bf16 fell to
# ~170, below fp32 (torch 2.13): the inversion that flags alone cannot foresee.
KERNEL_ENVIRONMENT = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "ATEN_CPU_CAPABILITY",
)
# The /proc/cpuinfo fields that tell CPUs apart: a VM's model name can be as bare as a vendor's line, the
# same for generations with and without AVX-512 BF16.
CPU_IDENTITY_FIELDS = ("model name", "cpu family", "model", "stepping")


def _cpuinfo_fields() -> dict[str, str]:
    """Return the first processor's `CPU_IDENTITY_FIELDS` and "flags" from /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return fields
    for line in lines:
        if not line.strip():
            break  # the end of the first processor's block
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """Return the CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def cpu_identity() -> str:
    """Return the CPU as a cached measurement is keyed: its model name, family, model and stepping, and a digest
    of its flags (a VM's flags change with its host's), e.g. "<model> | family 26 model 2 stepping 1 | flags 25fc08b1".
    """
    fields = _cpuinfo_fields()
    numbers = " ".join(f"{name.split()[-1]} {fields[name]}" for name in CPU_IDENTITY_FIELDS[1:] if name in fields)
    flags = fields.get("flags")
    digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8] if flags else None
    return " | ".join(part for part in (cpu_model(), numbers, digest and f"flags {digest}") if part)


def kernel_environment() -> str:
    """Return the `KERNEL_ENVIRONMENT` variables that are set, as "NAME=value" joined by spaces ("" when none is)."""
    return " ".join(f"{name}={os.environ[name]}" for name in KERNEL_ENVIRONMENT if os.environ.get(name))


def cache_key() -> str:
    """Return what a cached measurement is valid for: the CPU (`cpu_identity`), torch threads, torch version,
    shapes, and any variable of `KERNEL_ENVIRONMENT` that is set."""
    key = f"{cpu_identity()} | threads {torch.get_num_threads()} | torch {torch.__version__} | shapes {MODEL_SHAPES}"
    environment = kernel_environment()
    return f"{key} | {environment}" if environment else key


def cache_path() -> Path:
    """Return the cache file (`$POLO_CACHE/matmul_rates.json`, else `~/.cache/polo/matmul_rates.json`)."""
    return Path(os.environ.get("POLO_CACHE", Path.home() / ".cache" / "polo")).expanduser() / "matmul_rates.json"


def pack_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Return `weight` (out, in) packed once for oneDNN for about `rows` rows, or None where this torch build cannot.

    What torch.compile's CPU freezing pass calls; `packed_linear` multiplies with it. Shared by the rate
    probe and the sampler's prepacked layers (polo.kernels.cpu.linear).
    """
    if not packing_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except RuntimeError:  # a dtype or layout this build does not pack
        return None


def packing_available() -> bool:
    """Return True when this torch build has oneDNN and its weight-packing and packed-matmul ops."""
    mkldnn_ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn_ops, "_reorder_linear_weight")
        and hasattr(mkldnn_ops, "_linear_pointwise")
    )


def packed_linear(x: torch.Tensor, *, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Return x · weightᵀ (+ bias) with a weight from `pack_linear_weight`: x (..., in) -> (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def time_matmuls(dtypes=(torch.float32, torch.bfloat16), shapes=MODEL_SHAPES, repeats: int = REPEATS, packed=()):
    """Return, per dtype and then per dtype of `packed`, the median rate in GFLOP/s of `a @ b` over `shapes` (best of
    `repeats` each, after a warm-up); a `packed` dtype multiplies through `packed_linear` (0 where it cannot).

    The kinds take turns on every shape, so a load that comes and goes on a shared machine
    slows all alike and the comparison between them holds.
    """
    rates: list[list[float]] = [[] for _ in (*dtypes, *packed)]
    generator = torch.Generator(device=torch.device("cpu")).manual_seed(0)
    for rows, inner, columns in shapes:
        a = torch.randn(rows, inner, generator=generator, device=torch.device("cpu"))
        b = torch.randn(inner, columns, generator=generator, device=torch.device("cpu"))
        calls = [functools.partial(torch.matmul, a.to(dtype), b.to(dtype)) for dtype in dtypes]
        for dtype in packed:
            weight = pack_linear_weight(b.t().contiguous().to(dtype), rows)
            calls.append(None if weight is None else functools.partial(packed_linear, a.to(dtype), packed=weight))
        best = [float("inf")] * len(calls)
        for repeat in range(repeats + 1):  # the first round warms up: oneDNN picks and caches its kernel then
            for index, call in enumerate(calls):
                if call is None:
                    continue
                start = time.perf_counter()
                call()
                if repeat:
                    best[index] = min(best[index], time.perf_counter() - start)
        for index, seconds in enumerate(best):
            rates[index].append(2.0 * rows * inner * columns / seconds / 1e9)
    return [sorted(values)[len(values) // 2] for values in rates]


def native_bf16() -> bool:
    """Return True when this CPU lists native bf16 matmul instructions (AVX-512 BF16 or AMX) in /proc/cpuinfo."""
    flags = set(_cpuinfo_fields().get("flags", "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def measure_rates() -> MatmulRates:
    """Return freshly measured fp32, bf16 and oneDNN-packed fp32 matmul rates of this CPU (a fraction of a second).

    bf16 is timed only where the CPU has native bf16 (0 elsewhere): emulated, it ran at ~3 GFLOP/s and
    the probe took 13 s (oneDNN held to AVX2).
    """
    with torch.no_grad():
        if native_bf16():
            fp32, bf16, fp32_packed = time_matmuls(packed=(torch.float32,))
        else:
            (fp32, fp32_packed), bf16 = time_matmuls(dtypes=(torch.float32,), packed=(torch.float32,)), 0.0
    return MatmulRates(fp32=fp32, bf16=bf16, fp32_packed=fp32_packed)


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
    if isinstance(entry, dict) and {"fp32", "bf16", "fp32_packed"} <= entry.keys():
        return MatmulRates(float(entry["fp32"]), float(entry["bf16"]), True, float(entry["fp32_packed"]))
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
