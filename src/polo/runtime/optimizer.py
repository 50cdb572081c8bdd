"""The one optimizer builder: AdamW (or RMSprop) and its learning-rate schedule from an `OptimizerConfig`.

`polo train` (the policy and PPO's separate critic), `polo sft` / `rm` / `dpo` and `polo control`
all build their optimizers here, so the same `train` keys mean the same thing everywhere and the
fused kernel is used wherever it may be.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from polo.config.schema import OptimizerConfig
from polo.core.schedules import lr_multiplier

OPTIMIZERS = ("adamw", "rmsprop")


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter],
    settings: OptimizerConfig,
    *,
    learning_rate: float | None = None,
    kind: str = "adamw",
) -> torch.optim.Optimizer:
    """Return AdamW (or RMSprop, α 0.99) over `parameters` with the settings' rate, betas, ε and weight decay.

    `learning_rate` replaces `settings.learning_rate` (PPO's critic, a control critic's own rate);
    every parameter group remembers it as `initial_lr`, which a schedule scales. The fused kernel
    (one kernel per step: faster, no full-size temporaries) is used unless a parameter is an FSDP
    shard (a DTensor), which it does not take.
    """
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer {kind!r} is not one of {', '.join(OPTIMIZERS)}")
    parameters = list(parameters)
    rate = settings.learning_rate if learning_rate is None else learning_rate
    if kind == "rmsprop":
        optimizer: torch.optim.Optimizer = torch.optim.RMSprop(parameters, lr=rate, alpha=0.99, eps=settings.adam_eps)
    else:
        optimizer = torch.optim.AdamW(
            parameters,
            lr=rate,
            betas=(settings.adam_beta1, settings.adam_beta2),
            eps=settings.adam_eps,
            weight_decay=settings.weight_decay,
            fused=not any(is_dtensor(parameter) for parameter in parameters),
        )
    for group in optimizer.param_groups:
        group["initial_lr"] = rate
    return optimizer


def build_schedule(
    optimizer: torch.optim.Optimizer, settings: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Return the warm-up-then-schedule of `settings` over `total_steps` optimizer steps (`polo.core.lr_multiplier`)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(settings.warmup_steps, total_steps, settings.lr_schedule)
    )


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Return True for a DTensor (a shard of an FSDP2 model), which fused AdamW does not take."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
