"""A guard for device discipline: `with implicit_device_guard(): ...` fails where a tensor's device was left implicit.

Inside the block

- a torch factory (`torch.zeros`, `ones`, `empty`, `full`, `arange`, `rand`, `randn`, `randint`,
  `tensor`, `eye`, `linspace`, ... every function `torch.set_default_device` would place) called
  from polo's own code without `device=` raises `ImplicitDeviceError`, naming the function and
  the caller's file:line. Calls from other packages (transformers, peft, torch itself) are not
  polo's to fix and pass, as do `*_like` factories and `tensor.new_*` (they take their device from a tensor);
- the default device is `meta` (`default_device`), so an implicit allocation the check cannot
  see (a third-party factory, `nn.Module` built by a library) holds no data and fails loudly
  as soon as it meets a real tensor;
- an op given tensors on two devices raises `DeviceMixError` (0-dim CPU tensors are exempt, as
  torch exempts them; `Tensor.to` and `copy_` move data between devices by design).

On a CPU-only machine this is how polo shows it would place everything on a GPU: a run that
passes under the guard creates every tensor on a device it was given. It is a test tool (every
torch call goes through Python while it is on): `tests/runtime/test_device_guard.py` runs whole
GRPO, PPO, SFT and DPO steps and an evaluation batch under it. Set the model and its inputs on
their device before entering (loading a model under a meta default leaves its buffers on meta).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

__all__ = ["DeviceGuardMode", "DeviceMixError", "ImplicitDeviceError", "implicit_device_guard"]

POLO_ROOT = Path(__file__).resolve().parents[1]  # src/polo
_TORCH_ROOT = str(Path(torch.__file__).resolve().parent)
_THIS_FILE = str(Path(__file__).resolve())


class ImplicitDeviceError(RuntimeError):
    """A tensor factory called from a watched file without `device=`."""


class DeviceMixError(RuntimeError):
    """One op given tensors that live on different devices."""


def _movers() -> set:
    """Return the functions that take tensors on two devices by design (moving data between them)."""
    return {
        torch.Tensor.to,
        torch.Tensor.copy_,
        torch.Tensor.cpu,
        torch.Tensor.cuda,
        torch.Tensor.type,
        torch.Tensor.type_as,
    }


def _function_name(func) -> str:
    """Return "torch.zeros" / "Tensor.add" / "torch.fft.fftfreq" for a torch function, as a reader would write it."""
    qualified = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    owner, _, name = qualified.rpartition(".")
    if owner in ("Tensor", "TensorBase", "_TensorBase"):
        return f"Tensor.{name}"
    if owner == "_VariableFunctionsClass":  # torch.zeros and the other functions of the torch namespace
        return f"torch.{name}"
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{qualified}" if module.startswith("torch") else qualified


def _caller() -> tuple[str, int]:
    """Return (file, line) of the innermost frame outside torch and this module: whoever asked torch for the op."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_TORCH_ROOT) or filename == _THIS_FILE or filename.startswith("<frozen")):
            return filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


def _tensor_devices(values, devices: set) -> None:
    """Add the devices of the tensors among `values` (and inside lists, tuples and dicts) to `devices`, 0-dim CPU
    tensors aside."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dim() or value.device.type != "cpu":
                devices.add(value.device)
        elif isinstance(value, (list, tuple)):
            _tensor_devices(value, devices)
        elif isinstance(value, dict):
            _tensor_devices(value.values(), devices)


class DeviceGuardMode(TorchFunctionMode):
    """The function mode of `implicit_device_guard`: fails on implicit factories in `watched` files, and on device
    mixes."""

    def __init__(self, watched: tuple[Path, ...] = (POLO_ROOT,)):
        super().__init__()
        # a directory watches the files under it (its name with a separator: polo/ is not polo_plugin/)
        self.watched = tuple(str(Path(path).resolve()) + (os.sep if Path(path).is_dir() else "") for path in watched)
        self.factories = _device_constructors()
        self.movers = _movers()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None:
            filename, line = _caller()
            if filename.startswith(self.watched):
                raise ImplicitDeviceError(
                    f"{_function_name(func)}() without device= at {_relative(filename)}:{line}: the tensor would "
                    "land on whatever the default device is; pass device= (the run's Compute.device, or an input "
                    "tensor's .device)"
                )
        if func not in self.movers:
            devices: set = set()
            _tensor_devices(args, devices)
            _tensor_devices(kwargs.values(), devices)
            if len(devices) > 1:
                filename, line = _caller()
                raise DeviceMixError(
                    f"{_function_name(func)}() mixes tensors on {', '.join(sorted(map(str, devices)))} "
                    f"at {_relative(filename)}:{line}: "
                    "a tensor was created on an implicit device, or one input was never moved to the run's device"
                )
        return func(*args, **kwargs)


def _relative(filename: str) -> str:
    """Return `filename` from the `polo/` package on (as in "polo/rl/step.py"), else as it is."""
    path = Path(filename)
    try:
        return path.resolve().relative_to(POLO_ROOT.parent).as_posix()
    except ValueError:
        return filename


@contextlib.contextmanager
def implicit_device_guard(
    default_device: str | torch.device | None = "meta", watched: tuple[Path, ...] = (POLO_ROOT,)
) -> Iterator[None]:
    """Within the block, fail on tensors created on an implicit device and on ops that mix devices (see the module doc).

    `default_device` is the default device inside the block ("meta": implicit allocations hold no
    data; None leaves the default alone, e.g. to load models under the factory check). `watched`
    are the files and directories whose factory calls must name a device (polo's source).
    """
    with contextlib.ExitStack() as stack:
        if default_device is not None:
            stack.enter_context(torch.device(default_device))
        stack.enter_context(DeviceGuardMode(watched))
        yield
