"""The divergence guard: a step that ruins the weights stops the run before they are saved anywhere.

A NaN or infinite loss is caught before its update (`polo.rl.update` skips the step), but a finite
loss can still carry an update that wrecks the weights: at `train.learning_rate=1`, the top of its
range, step 1's loss and gradient are finite and Adam moves every weight by about 1, many times its
size, which only the next step's loss would show. So the guard judges each step after its update,
before it is logged as good, evaluated or checkpointed:

- the global weight norm must stay finite and within `train.divergence_factor` times the last
  accepted step's (the starting weights' for step 1); weights move little per step, so a jump
  there is damage, not noise;
- with `train.divergence_checks` naming them, the loss magnitude and the gradient norm (before
  clipping) must stay within the factor times the median of the accepted steps so far (judged
  from the fourth accepted step on). They are off by default: policy-gradient losses hover around
  zero and a group with spread after groups without one multiplies the gradient norm, so their
  ratios flag healthy steps, and clipping already bounds what a gradient spike can do.

On a divergence the step is never logged as good, evaluated or saved, and (`train.on_divergence`):

- **rollback** (the default): the run goes back to the last checkpoint, which was written before
  the jump because every saved step passed the guard (or to the untouched starting model when none
  was written), with its weights, optimizer, schedule, critic and random streams, and goes on from
  there. Replaying the same steps would draw the same prompts and take the same jump, so the
  batches drawn between the checkpoint and the jump are skipped (`Run.data_offset`; PaLM, Chowdhery
  et al. 2022 §5.1, restarted about 100 steps before a loss spike and skipped 200-500 batches). The
  rebuild goes through the same code as `output.resume=true` (`polo.rl.setup.set_up`). After
  `train.max_rollbacks` rollbacks in one run it stops instead: a jump that comes back on fresh
  data is the settings' fault (usually the learning rate), not the data's.
- **stop**: the run stops and its one line names where it stands: that checkpoint, which
  `output.resume=true` continues from, or the untouched starting model.

The guard keeps no copy of the weights (the checkpoint on disk, or the starting model, is the
copy), only a few numbers; computing the norm is one pass over the parameters per step.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from polo.config import Config, ConfigError
from polo.runtime import parallel
from polo.runtime.checkpoint import Checkpointer
from polo.runtime.errors import DivergenceError

CHECKS = ("weight_norm", "grad_norm", "loss")
WARMUP_STEPS = 3  # accepted steps before a loss or gradient norm median means anything
HISTORY = 20  # accepted steps the median looks back over


@dataclass
class RollbackState:
    """Where a run stands with rollbacks: the batches it skips, how many it took, and (on a rollback) where to."""

    data_offset: int = 0
    rollbacks: int = 0
    eval_before: dict | None = None
    checkpoint: Path | None = None  # the checkpoint to roll back to; None: the starting model
    message: str = ""


def check_guard_settings(config: Config) -> None:
    """Raise `ConfigError` for a divergence factor or check name that makes no sense (before the model loads)."""
    factor = config.train.divergence_factor
    if not (math.isfinite(factor) and (factor == 0 or factor > 1)):
        raise ConfigError(
            "train.divergence_factor must be 0 (only non-finite weights stop the run) or a finite number above 1, "
            f"got {factor}"
        )
    unknown = [name for name in config.train.divergence_checks if name not in CHECKS]
    if unknown:
        raise ConfigError(f"train.divergence_checks: unknown check {unknown[0]!r}; choose from {', '.join(CHECKS)}")


@torch.no_grad()
def weight_norm(model: torch.nn.Module) -> float:
    """Return the L2 norm of all of `model`'s weights (whole, also when FSDP shards them over ranks)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    norms = torch._foreach_norm([tensor.detach() for tensor in local if tensor.numel()])
    squares = float(torch.stack([norm.double() for norm in norms]).square().sum()) if norms else 0.0
    if parallel.is_sharded(model):
        squares = parallel.sum_over_ranks({"squares": squares})["squares"]
    return math.sqrt(squares)


class DivergenceGuard:
    """Judges each step's weights (and optionally loss and gradient norm) against the steps accepted before it."""

    def __init__(self, model: torch.nn.Module, config: Config, checkpointer: Checkpointer):
        self.model, self.model_name, self.checkpointer = model, config.model.name, checkpointer
        self.factor = config.train.divergence_factor
        self.checks = set(config.train.divergence_checks)
        self.last_weight_norm, self.last_step = weight_norm(model), None
        self.history: dict[str, list[float]] = {"loss": [], "grad_norm": []}

    def judge(self, step: int, metrics: dict) -> str | None:
        """Return the one-line reason the step diverged (None: accepted), after adding `weight_norm` to `metrics`."""
        values = {"weight_norm": weight_norm(self.model)}
        metrics["weight_norm"] = values["weight_norm"]
        values.update({key: abs(metrics[key]) for key in self.history if isinstance(metrics.get(key), (int, float))})
        reason = next((why for why in map(self.jump, values.items()) if why), None)
        if reason is None:
            self.last_weight_norm, self.last_step = values["weight_norm"], step
            for key in self.history:
                if key in values:
                    self.history[key] = (self.history[key] + [values[key]])[-HISTORY:]
            return None
        return f"step {step} diverged: {reason}"

    def jump(self, item: tuple[str, float]) -> str | None:
        """Return why `value` of `name` is a divergence, or None."""
        name, value = item
        if not math.isfinite(value):
            return f"{name} is {value}"
        if not self.factor or name not in self.checks:
            return None
        if name == "weight_norm":
            reference = self.last_weight_norm
            against = f"step {self.last_step}'s" if self.last_step is not None else "the starting weights'"
        else:
            accepted = [seen for seen in self.history[name] if seen > 0]
            if len(accepted) < WARMUP_STEPS:
                return None
            reference, against = statistics.median(accepted), f"the median of {len(accepted)} accepted steps'"
        if reference > 0 and value > self.factor * reference:
            return (
                f"{name} {value:.4g} is {value / reference:.3g}x {against} {reference:.4g} "
                f"(train.divergence_factor={self.factor:g})"
            )
        return None

    def rollback_or_stop(self, step: int, reason: str, run_state: RollbackState, config: Config) -> RollbackState:
        """Return where the run rolls back to after `reason` at `step`, or raise `DivergenceError` to stop it."""
        latest = self.checkpointer.latest()
        if config.train.on_divergence == "stop" or run_state.rollbacks >= config.train.max_rollbacks:
            tried = (
                f"; {run_state.rollbacks} rollbacks did not help (train.max_rollbacks={config.train.max_rollbacks})"
                if run_state.rollbacks
                else ""
            )
            raise DivergenceError(f"{reason}{tried}; {self.where_the_run_stands(step, latest)}")
        checkpoint_step = int(latest.name.split("-")[1]) if latest is not None else 0
        return RollbackState(
            checkpoint=latest,
            data_offset=run_state.data_offset + step - checkpoint_step,  # step s draws position s - 1 + offset
            rollbacks=run_state.rollbacks + 1,
            eval_before=run_state.eval_before,
            message=(
                f"polo: warning: {reason}; rolling back to {latest or 'the starting model ' + self.model_name} and "
                f"skipping the {step - checkpoint_step} batch(es) drawn since (rollback {run_state.rollbacks + 1} "
                f"of at most {config.train.max_rollbacks}, train.max_rollbacks)"
            ),
        )

    def where_the_run_stands(self, step: int, latest: Path | None) -> str:
        """Return what is on disk after stopping at `step`, and how to go on from it."""
        if latest is not None:
            return (
                f"the run stopped without saving it; its last checkpoint, written before the jump, is {latest}: "
                "continue from it with output.resume=true and a lower train.learning_rate"
            )
        return (
            f"the run stopped without saving it; no checkpoint was written before step {step} and the starting model "
            f"{self.model_name} is untouched: start again with a lower train.learning_rate and output.overwrite=true"
        )
