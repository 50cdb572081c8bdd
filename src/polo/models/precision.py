"""bf16 training with fp32 master weights, on the run's device (`Compute.master_weights`).

`train.precision` chooses how the policy's forward and backward are computed:

    fp32          fp32 weights, fp32 compute
    bf16          fp32 weights; bf16 autocast casts the inputs of every matmul (the residual
                  stream, norms and element-wise work stay fp32)
    bf16_master   the model's own weights are bf16, so the whole forward and backward run in
                  bf16 with no casts; the optimizer owns fp32 master copies (and fp32 AdamW
                  state), receives every gradient in fp32 and writes the updated masters back
                  into the bf16 weights after each step (`MasterWeights`)

Both bf16 modes keep fp32 master weights and fp32 optimizer state, so an update of size
lr · m/√v far below bf16's resolution (2⁻⁸ relative) still accumulates. `bf16_master` is what
FSDP calls mixed precision with `param_dtype=bf16`; on an AVX-512-BF16 CPU it made the
GRPO update of SmolLM2-135M about 30% faster than autocast (see benchmarks/grpo_vs_trl.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from polo.config.schema import OptimizerConfig
from polo.runtime.device import Compute
from polo.runtime.optimizer import build_optimizer

__all__ = ["MasterWeights", "master_weights", "trainer_optimizer"]


class MasterWeights:
    """fp32 master copies of a model's trainable parameters, which are cast to `dtype` in place.

    Give `parameters` to the optimizer and call `attach(optimizer)`: each bf16 gradient is
    added into its master's fp32 `.grad` as soon as autograd finishes accumulating it (and the
    bf16 gradient is freed), so gradient accumulation over micro-batches sums in fp32. A master's
    `.grad` is made afresh in each backward and freed by the optimizer's `zero_grad(set_to_none=True)`:
    the backward frees activations as it makes gradients, and the allocator hands that memory on.
    Keeping the 515 MiB of SmolLM2-135M's fp32 gradients for the whole run instead (as polo did)
    put them all under the activations' peak: the bench job's peak RSS was 4,345-4,425 MiB against
    4,033-4,073 MiB, and its update 6.38-7.37 s against 6.37-6.69 s (three alternating pairs,
    torch 2.13; an earlier measurement, with activations recomputed and so little memory freed
    in backward, had a fresh embedding gradient cost 60 ms a step in page faults). After
    every `optimizer.step()` the masters are copied back into the model, in place (the weights keep
    their storage, so a captured CUDA graph that reads them stays valid). Tied parameters
    (one `Parameter` used twice) have one master. Buffers are left alone.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for parameter in model.parameters():  # tied parameters come once
            if not parameter.requires_grad:
                continue
            master = torch.nn.Parameter(parameter.detach().to(torch.float32, copy=True))
            parameter.data = parameter.data.to(dtype)
            parameter.register_post_accumulate_grad_hook(self._move_grad(master))
            self.pairs.append((parameter, master))
        self._master_of = {id(parameter): master for parameter, master in self.pairs}

    @staticmethod
    def _move_grad(master: torch.nn.Parameter):
        def hook(parameter: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = torch.empty_like(master).copy_(parameter.grad)  # contiguous, as the master
            else:
                master.grad.add_(parameter.grad)
            parameter.grad = None

        return hook

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """Return the fp32 master parameters, in the model's parameter order (what the optimizer steps)."""
        return [master for _, master in self.pairs]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the masters into the model after every step of `optimizer`."""
        optimizer.register_step_post_hook(lambda *_: self.push())

    @torch.no_grad()
    def push(self) -> None:
        """Write the fp32 masters into the model's low-precision weights (rounded to nearest)."""
        for parameter, master in self.pairs:
            parameter.copy_(master)

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Return `model.state_dict()`, every trained weight replaced by its fp32 master (what a checkpoint saves)."""
        return {
            name: self._master_of.get(id(tensor), tensor).detach()
            for name, tensor in model.state_dict(keep_vars=True).items()
        }


def master_weights(model: torch.nn.Module, compute: Compute) -> MasterWeights | None:
    """Return fp32 masters of `model`'s trainable weights under bf16_master, casting the model to `compute.param_dtype`.

    None for every other precision: the model keeps its weights as they are. `polo train` and
    `polo sft` / `rm` / `dpo` all take their masters here, after any frozen copy has been made.
    """
    return MasterWeights(model, compute.param_dtype) if compute.master_weights else None


def trainer_optimizer(
    parameters: Iterable[torch.nn.Parameter], settings: OptimizerConfig, masters: MasterWeights | None
) -> torch.optim.Optimizer:
    """Return the run's optimizer (`polo.runtime.optimizer`) over `parameters`, or over the fp32 `masters` when given.

    With masters, the optimizer steps them and copies them back into the model after each step.
    """
    optimizer = build_optimizer(masters.parameters if masters is not None else parameters, settings)
    if masters is not None:
        masters.attach(optimizer)
    return optimizer
