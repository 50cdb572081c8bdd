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
from dataclasses import dataclass, field, replace

import torch

from polo import core
from polo.config import Config, ConfigError
from polo.config.schema import DEVICE_HELP
from polo.runtime import parallel
from polo.runtime.rates import cached_rates, native_bf16

PRECISIONS = ("fp32", "bf16", "bf16_master", "bf16_weights")


@dataclass(frozen=True)
class Compute:
    """Where a run computes and in what precision; resolved once per run (`trainer_compute`, `inference_compute`).

    `param_dtype` is the dtype the model's weights are held in, `autocast_dtype` the dtype of
    the autocast region around forward passes (None: no autocast), and `master_weights` whether
    the optimizer keeps fp32 masters of low-precision weights (polo.models.precision).
    """

    device: torch.device
    param_dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None
    master_weights: bool = False
    basis: str = field(default="", compare=False)  # why this precision: the measured rates, or "explicit"

    @classmethod
    def named(cls, name: str, device: torch.device | str = "cpu") -> Compute:
        """Return the Compute for a resolved precision name (see the module doc) on `device`."""
        device = torch.device(device)
        if name == "fp32":
            return cls(device)
        if name == "bf16":
            return cls(device, autocast_dtype=torch.bfloat16)
        if name == "bf16_master":
            return cls(device, param_dtype=torch.bfloat16, master_weights=True)
        if name == "bf16_weights":
            return cls(device, param_dtype=torch.bfloat16)
        raise ValueError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}")

    @property
    def precision(self) -> str:
        """Return the precision's name: fp32, bf16, bf16_master or bf16_weights."""
        if self.master_weights:
            return "bf16_master"
        if self.autocast_dtype is not None:
            return "bf16"
        return "bf16_weights" if self.param_dtype != torch.float32 else "fp32"

    @property
    def frozen_dtype(self) -> torch.dtype | None:
        """Return the dtype of a frozen copy that is never trained (the KL reference): bf16 under any bf16 precision,
        else None (as loaded)."""
        if self.autocast_dtype is not None:
            return self.autocast_dtype
        return self.param_dtype if self.param_dtype != torch.float32 else None

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

    def available_memory(self) -> int | None:
        """Return the bytes of memory free for this process on its device (None: unknown): the GPU's free memory, or
        the host's available memory, capped by a cgroup (container) limit and shared among the processes torchrun
        started on this host (`LOCAL_WORLD_SIZE`)."""
        if self.is_cuda:
            return int(torch.cuda.mem_get_info(self.device)[0])
        if self.device.type != "cpu":
            return None
        available = host_available_memory()
        try:
            local_processes = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        except ValueError:
            local_processes = 1
        return None if available is None else available // local_processes

    def generator(self, seed: int | None = None) -> torch.Generator:
        """Return a torch.Generator on the run's device (seeded when `seed` is given)."""
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(seed)
        return generator

    def __str__(self) -> str:
        where = f"{self.precision} on {self.device}"
        return f"{where} ({self.basis})" if self.basis else where


def host_available_memory() -> int | None:
    """Return the bytes this process could still allocate on the host: MemAvailable from /proc/meminfo, capped by
    the cgroup v2 limit less its usage when one is set; None where neither can be read (not Linux)."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as current:
            text = limit.read().strip()
            if text != "max":
                room = max(int(text) - int(current.read().strip()), 0)
                available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """Within the block torch runs `threads` intra-op threads (None: as many as it had); after it, as many as before.

    The count is one setting for the whole process, and it decides how reductions split their sums
    (polo's RMSNorm weight gradient, torch's own): a run that set it and left it would change the
    numbers of every later run in the same process, a test suite's among them.
    """
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
            raise ConfigError(
                f"device {spec!r}: this torch sees no CUDA GPU (torch {torch.__version__}); use device=cpu or auto"
            )
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
    """Return True when this CPU has native bf16 matmuls (AVX-512 BF16 or AMX; `polo.runtime.rates.native_bf16`)."""
    return native_bf16()


def bf16_choice(device: torch.device) -> tuple[bool, str]:
    """Return (whether bf16 is the faster choice on `device`, the reason in a few words).

    A GPU: bf16 where it supports it. A CPU: only where it has native bf16 (AVX-512 BF16 or AMX)
    *and* bf16 matmuls measured faster than fp32 ones at a language model's shapes
    (`polo.runtime.rates`, measured once per machine and cached). Under torchrun every rank takes
    rank 0's measurement, so all ranks train in one precision.
    """
    if device.type == "cuda":
        return (True, "CUDA bf16") if torch.cuda.is_bf16_supported() else (False, "no bf16 on this GPU")
    if not cpu_supports_bf16():
        return False, "no native bf16 on this CPU"
    rates = parallel.gather_objects(cached_rates())[0]
    return rates.bf16_faster, rates.describe()


def bf16_pays(device: torch.device) -> bool:
    """Return True when bf16 is the faster choice on `device` (see `bf16_choice`)."""
    return bf16_choice(device)[0]


def auto_precision(device: torch.device, bf16_name: str, fp32_name: str = "fp32") -> tuple[str, str]:
    """Return (the precision `auto` resolves to on `device`, why): `bf16_name` where bf16 pays, else `fp32_name`."""
    pays, why = bf16_choice(device)
    return (bf16_name if pays else fp32_name), f"auto: {why}"


def inference_compute(name: str = "auto", device: str | torch.device = "auto") -> Compute:
    """Return the Compute of a sampling / evaluation job: `auto | fp32 | bf16` on `auto | cpu | cuda[:N]`.

    bf16 (and auto where bf16 pays) holds the weights in bf16 with no autocast: nothing trains, so
    no fp32 master is needed, and every matmul runs in bf16 as RL sampling does under bf16_master.
    """
    torch_device = resolve_device(device)
    if name not in ("auto", "fp32", "bf16", *PRECISIONS):
        raise ConfigError(f"precision {name!r} is not one of auto, fp32, bf16")
    basis = "explicit"
    if name == "auto":
        name, basis = auto_precision(torch_device, "bf16")
    return replace(Compute.named("fp32" if name == "fp32" else "bf16_weights", torch_device), basis=basis)


def autocast_compute(name: str = "auto", device: str | torch.device = "auto") -> Compute:
    """Return the Compute of scoring in fp32 weights (a reward model as a reward function): bf16 autocast where chosen.

    `name` is auto | fp32 | bf16; auto is bf16 where bf16 pays on the device (`bf16_pays`).
    Training jobs resolve theirs with `trainer_compute`.
    """
    torch_device = resolve_device(device)
    if name not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"precision {name!r} is not one of auto, fp32, bf16")
    basis = "explicit"
    if name == "auto":
        name, basis = auto_precision(torch_device, "bf16")
    return replace(Compute.named(name, torch_device), basis=basis)


def one_process_only() -> str | None:
    """Return why master weights cannot train in this process group (None in one process: they can)."""
    if parallel.world_size() > 1:
        return f"it trains in one process only (this run has {parallel.world_size()})"
    return None


def master_weights_unsupported(config: Config) -> str | None:
    """Return why `train.precision=bf16_master` cannot train this RL run (None when it can)."""
    if reason := one_process_only():
        return reason
    if core.ADVANTAGE_ESTIMATORS.entry(config.algorithm.advantage_estimator).needs_critic:
        return "PPO's critic is trained in fp32 weights (use train.precision=bf16)"
    return None


def trainer_compute(name: str, device: str | torch.device, master_weights_blocked: str | None) -> Compute:
    """Return the Compute of a trainer (`polo train`, `sft`, `rm`, `dpo`) from its `train.precision` and `train.device`.

    `name` "auto" picks bf16_master where bf16 pays on the device (`bf16_choice`) and nothing
    blocks master weights (`master_weights_blocked` is the reason when something does), else bf16
    autocast where bf16 pays, else fp32. An explicit precision wins; bf16_master where it is
    blocked is a ConfigError that says why.
    """
    torch_device = resolve_device(device)
    if name not in ("auto", "fp32", "bf16", "bf16_master"):
        raise ConfigError(f"train.precision {name!r} is not one of auto, fp32, bf16, bf16_master")
    basis = "explicit"
    if name == "auto":
        name, basis = auto_precision(torch_device, "bf16" if master_weights_blocked else "bf16_master")
    elif name == "bf16_master" and master_weights_blocked:
        raise ConfigError(f"train.precision=bf16_master: {master_weights_blocked}")
    return replace(Compute.named(name, torch_device), basis=basis)


def train_compute(config: Config) -> Compute:
    """Return the RL policy trainer's Compute from `train.device` and `train.precision` (`trainer_compute`).

    Master weights need one process and no critic (`master_weights_unsupported`).
    """
    return trainer_compute(config.train.precision, config.train.device, master_weights_unsupported(config))


def finetune_compute(name: str = "auto", device: str | torch.device = "auto") -> Compute:
    """Return the Compute of `polo sft`, `rm` and `dpo` for `name`: `polo train`'s decision (`trainer_compute`).

    Master weights need one process (`one_process_only`); there is no critic to block them.
    """
    return trainer_compute(name, device, one_process_only())


def memory_metrics(compute: Compute) -> dict[str, float]:
    """Return the device's peak allocated memory since the last call, in GiB (CUDA only; {} on the CPU)."""
    if not compute.is_cuda:
        return {}
    peak = torch.cuda.max_memory_allocated(compute.device) / 2**30
    torch.cuda.reset_peak_memory_stats(compute.device)
    return {"gpu_max_memory_allocated_gib": peak}
