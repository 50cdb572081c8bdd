"""The one place that decides where and in what precision polo computes.

Everything device-specific sits behind these functions: whether the CPU has native bf16, the
autocast context for a precision, and which precision a run trains in ("auto" resolved once).
Callers receive the answer and never ask the hardware themselves.
"""

from __future__ import annotations

import contextlib

import torch

from polo import core
from polo.config import Config, ConfigError
from polo.runtime import distributed as parallel

def autocast_context(precision: str) -> contextlib.AbstractContextManager:
    """Return the autocast context for `precision` on the CPU: bf16 autocast for "bf16", none otherwise.

    ("bf16_master" models already hold bf16 weights, see polo.models.precision: nothing to cast.)
    """
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()



def cpu_supports_bf16() -> bool:
    """Return True when this CPU has native bf16 matmuls (AVX-512 BF16 or AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_precision(precision: str) -> str:
    """Return "bf16" or "fp32" for a configured precision ("auto" picks bf16 where the CPU has it)."""
    if precision == "auto":
        return "bf16" if cpu_supports_bf16() else "fp32"
    return precision



def master_weights_unsupported(config: Config) -> str | None:
    """Return why `train.precision=bf16_master` cannot train this run (None when it can)."""
    if parallel.world_size() > 1:
        return f"it trains in one process only (this run has {parallel.world_size()})"
    if core.ADVANTAGE_ESTIMATORS.entry(config.algorithm.advantage_estimator).needs_critic:
        return "PPO's critic is trained in fp32 weights (use train.precision=bf16)"
    return None



def resolve_train_precision(config: Config) -> str:
    """Return the policy trainer's precision: "fp32", "bf16" (autocast) or "bf16_master" (see polo.models.precision).

    "auto" picks bf16_master where the CPU has native bf16 and the run allows it (one process,
    no critic), else bf16 autocast on such CPUs, else fp32.
    """
    precision = config.train.precision
    if precision == "auto":
        if not cpu_supports_bf16():
            return "fp32"
        return "bf16" if master_weights_unsupported(config) else "bf16_master"
    if precision == "bf16_master" and (reason := master_weights_unsupported(config)):
        raise ConfigError(f"train.precision=bf16_master: {reason}")
    return precision
