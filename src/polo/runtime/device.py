"""The one place that decides where and in what precision polo computes: the `Compute` of a run.

A run resolves one `Compute` (device, parameter dtype, autocast dtype, master weights or not) at
set-up and hands it to everything that allocates or runs a model. Nothing outside `runtime/` and
`kernels/` asks which device it runs on or whether the hardware has bf16: callers read the
answer off the `Compute` they were given.

Precision names, as recipes and banners spell them:

    fp32          fp32 weights, fp32 compute
    bf16          fp32 weights, bf16 autocast around forward passes (fp32 master weights)
    bf16_master   bf16 weights with fp32 master copies in the optimizer (polo.models.precision)
    bf16_weights  bf16 weights and nothing else: sampling and evaluation only (no optimizer)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from polo import core
from polo.config import Config, ConfigError
from polo.runtime import distributed as parallel

PRECISIONS = ("fp32", "bf16", "bf16_master", "bf16_weights")
DEVICE_HELP = "auto | cpu | cuda | cuda:N (auto: CUDA when available, one GPU per torchrun rank)"


@dataclass(frozen=True)
class Compute:
    """Where a run computes and in what precision; resolved once per run (`train_compute`, `inference_compute`).

    `param_dtype` is the dtype the model's weights are held in, `autocast_dtype` the dtype of
    the autocast region around forward passes (None: no autocast), and `master_weights` whether
    the optimizer keeps fp32 masters of low-precision weights (polo.models.precision).
    """

    device: torch.device
    param_dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None
    master_weights: bool = False

    @classmethod
    def named(cls, precision: str, device: torch.device | str = "cpu") -> "Compute":
        """Return the Compute for a resolved precision name (see the module doc) on `device`."""
        device = torch.device(device)
        if precision == "fp32":
            return cls(device)
        if precision == "bf16":
            return cls(device, autocast_dtype=torch.bfloat16)
        if precision == "bf16_master":
            return cls(device, param_dtype=torch.bfloat16, master_weights=True)
        if precision == "bf16_weights":
            return cls(device, param_dtype=torch.bfloat16)
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")

    @property
    def precision(self) -> str:
        """Return the precision's name: fp32, bf16, bf16_master or bf16_weights."""
        if self.master_weights:
            return "bf16_master"
        if self.autocast_dtype is not None:
            return "bf16"
        return "bf16_weights" if self.param_dtype != torch.float32 else "fp32"

    @property
    def device_type(self) -> str:
        """Return the device's type ("cpu", "cuda", ...): for kernels/ and runtime/ to choose a path by."""
        return self.device.type

    @property
    def is_cuda(self) -> bool:
        """Return True when the run computes on a CUDA device."""
        return self.device.type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Return the autocast context of forward passes: bf16 autocast on the run's device, or none."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def generator(self, seed: int | None = None) -> torch.Generator:
        """Return a torch.Generator on the run's device (seeded when `seed` is given)."""
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(seed)
        return generator

    def __str__(self) -> str:
        return f"{self.precision} on {self.device}"


CPU = Compute(torch.device("cpu"))  # fp32 on the CPU: the default of library functions called without a run


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """Return the torch device for `auto | cpu | cuda | cuda:N`; raise ConfigError when it cannot be had.

    "auto" is CUDA when torch sees a GPU, else the CPU. "cuda" (or auto on a GPU) under torchrun is
    the GPU of the process's LOCAL_RANK (one GPU per rank).
    """
    if isinstance(spec, torch.device):
        return spec
    spec = str(spec).strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {spec!r}: this torch sees no CUDA GPU (torch {torch.__version__}); use device=cpu or auto")
        if spec == "cuda":
            index = int(os.environ.get("LOCAL_RANK", "0"))
        else:
            try:
                index = int(spec.split(":", 1)[1])
            except ValueError:
                raise ConfigError(f"device {spec!r} is not one of: {DEVICE_HELP}") from None
        if not 0 <= index < torch.cuda.device_count():
            raise ConfigError(f"device cuda:{index}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    raise ConfigError(f"device {spec!r} is not one of: {DEVICE_HELP}")


def cpu_supports_bf16() -> bool:
    """Return True when this CPU has native bf16 matmuls (AVX-512 BF16 or AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def bf16_pays(device: torch.device) -> bool:
    """Return True when bf16 is the faster choice on `device` (a GPU with bf16, or a CPU with native bf16)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_supports_bf16()


def inference_compute(precision: str = "auto", device: str | torch.device = "auto") -> Compute:
    """Return the Compute of a sampling / evaluation job: `auto | fp32 | bf16` on `auto | cpu | cuda[:N]`.

    bf16 (and auto where bf16 pays) holds the weights in bf16 with no autocast: nothing trains, so
    no fp32 master is needed, and every matmul runs in bf16 as RL sampling does under bf16_master.
    """
    torch_device = resolve_device(device)
    if precision not in ("auto", "fp32", "bf16", *PRECISIONS):
        raise ConfigError(f"precision {precision!r} is not one of auto, fp32, bf16")
    if precision == "auto":
        precision = "bf16" if bf16_pays(torch_device) else "fp32"
    return Compute.named("fp32" if precision == "fp32" else "bf16_weights", torch_device)


def autocast_compute(precision: str = "auto", device: str | torch.device = "auto") -> Compute:
    """Return the Compute of a supervised job (SFT, reward model, DPO): fp32 weights, bf16 autocast where chosen."""
    torch_device = resolve_device(device)
    if precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision {precision!r} is not one of auto, fp32, bf16")
    if precision == "auto":
        precision = "bf16" if bf16_pays(torch_device) else "fp32"
    return Compute.named(precision, torch_device)


def master_weights_unsupported(config: Config) -> str | None:
    """Return why `train.precision=bf16_master` cannot train this run (None when it can)."""
    if parallel.world_size() > 1:
        return f"it trains in one process only (this run has {parallel.world_size()})"
    if core.ADVANTAGE_ESTIMATORS.entry(config.algorithm.advantage_estimator).needs_critic:
        return "PPO's critic is trained in fp32 weights (use train.precision=bf16)"
    return None


def train_compute(config: Config) -> Compute:
    """Return the RL policy trainer's Compute from `train.device` and `train.precision`.

    "auto" precision picks bf16_master where bf16 pays on the device and the run allows it (one
    process, no critic), else bf16 autocast where bf16 pays, else fp32. An explicit precision wins.
    """
    device = resolve_device(getattr(config.train, "device", "auto"))
    precision = config.train.precision
    if precision == "auto":
        if not bf16_pays(device):
            precision = "fp32"
        else:
            precision = "bf16" if master_weights_unsupported(config) else "bf16_master"
    elif precision == "bf16_master" and (reason := master_weights_unsupported(config)):
        raise ConfigError(f"train.precision=bf16_master: {reason}")
    return Compute.named(precision, device)


def memory_metrics(compute: Compute) -> dict[str, float]:
    """Return the device's peak allocated memory since the last call, in GiB (CUDA only; {} on the CPU)."""
    if not compute.is_cuda:
        return {}
    peak = torch.cuda.max_memory_allocated(compute.device) / 2**30
    torch.cuda.reset_peak_memory_stats(compute.device)
    return {"gpu_max_memory_allocated_gib": peak}


# TRANSITION (deleted once every caller takes a Compute): the string-precision helpers of before.
def autocast_context(precision: str) -> contextlib.AbstractContextManager:
    """Return the CPU autocast context for a precision name (transition shim; use `Compute.autocast`)."""
    return Compute.named(precision if precision in PRECISIONS else "fp32").autocast()


def resolve_precision(precision: str) -> str:
    """Return "bf16" or "fp32" for a configured precision (transition shim; use `autocast_compute`)."""
    if precision == "auto":
        return "bf16" if cpu_supports_bf16() else "fp32"
    return precision


def resolve_train_precision(config: Config) -> str:
    """Return the trainer's precision name (transition shim; use `train_compute`)."""
    return train_compute(config).precision
