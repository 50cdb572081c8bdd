"""Callbacks: the user's code at the points of a run's lifecycle (`polo.runtime.lifecycle`), and early stopping.

Every trainer (`polo.train`, `polo.finetune.sft`, `rm`, `dpo`, `polo.control.train`) takes
`callbacks=[...]`, and a recipe names them in its output section:

    output:
      callbacks:
        - name: EarlyStopping            # polo's own; module:Name for a class of yours
          options: {metric: eval/loss, patience: 3, min_delta: 0.001, mode: min}

A callback is any object with some of these methods (`Callback` has them all, doing nothing):

    on_run_start(run: RunInfo)                   before the first evaluation and step
    on_step_end(step, metrics) -> reason | None  after each step's row is logged; a string stops the run
    on_evaluate(step, metrics) -> reason | None  after each held-out evaluation (`eval/...` keys)
    on_checkpoint(step, path)                    after each checkpoint is written
    on_run_end(result)                           with what the run returns, after it published

A run stopped by a callback ends as a finished run does, at that step: final evaluation (the one
just made, when the stop came from `on_evaluate`), final checkpoint, model card. The callbacks
are called on every process of a torchrun job with the same metrics; the run stops when any asks.
A callback's own state (EarlyStopping's best value) starts afresh when a run resumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polo.config import ConfigError
from polo.config.plugins import import_user_module


@dataclass(frozen=True)
class RunInfo:
    """What a callback learns at the start of a run: its kind, directory and steps."""

    name: str  # "polo train", "polo sft", ...
    output_dir: Path | None  # None: a run that writes nothing
    start_step: int  # 0, or the checkpoint's step when the run resumed
    total_steps: int


class Callback:
    """The callback protocol, every method doing nothing: subclass it and keep the ones you need."""

    def on_run_start(self, run: RunInfo) -> None:
        """Called once, after the run is built (resumed) and its trackers are open."""

    def on_step_end(self, step: int, metrics: dict) -> str | None:
        """Called after step `step`'s metrics row is logged; return a one-line reason to stop the run there."""
        return None

    def on_evaluate(self, step: int, metrics: dict) -> str | None:
        """Called after a held-out evaluation at `step` (its logged `eval/...` row); return a reason to stop."""
        return None

    def on_checkpoint(self, step: int, path: Path | None) -> None:
        """Called after checkpoint `step` is written (`path` is None off the main process)."""

    def on_run_end(self, result: Any) -> None:
        """Called with what the run returns (`TrainResult`, `FinetuneResult`, `ControlResult`)."""


MODES = ("min", "max")


class EarlyStopping(Callback):
    """Stops a run once held-out `metric` has not improved by more than `min_delta` for `patience` evaluations.

    `mode` is min (a loss) or max (an accuracy). The first evaluation (before training, or the
    first after a resume) sets the best value; each later one either improves on it or counts
    against `patience`. `metric` is a key of the evaluation row, with or without its `eval/`
    prefix: eval/accuracy for `polo train`, eval/loss for `polo sft` and `polo dpo`,
    eval/pair_accuracy for `polo rm`.
    """

    def __init__(self, metric: str = "eval/loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if mode not in MODES:
            raise ConfigError(f"EarlyStopping: mode {mode!r} is not one of {', '.join(MODES)}")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ConfigError(f"EarlyStopping: patience must be an integer >= 1, got {patience!r}")
        if not (isinstance(min_delta, (int, float)) and math.isfinite(min_delta) and min_delta >= 0):
            raise ConfigError(f"EarlyStopping: min_delta must be a finite number >= 0, got {min_delta!r}")
        self.metric, self.patience, self.min_delta, self.mode = metric, patience, float(min_delta), mode
        self.best: float | None = None
        self.waited = 0

    def value(self, metrics: dict) -> float:
        """Return the watched metric from an evaluation row; ConfigError naming the row's keys when it is absent."""
        for key in (self.metric, f"eval/{self.metric}"):
            if isinstance(metrics.get(key), (int, float)):
                return float(metrics[key])
        keys = ", ".join(key for key in metrics if key != "step")
        raise ConfigError(f"EarlyStopping: metric {self.metric!r} is not in the evaluation row; it has: {keys}")

    def improved(self, value: float) -> bool:
        """Return True when `value` beats the best so far by more than `min_delta`."""
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def on_evaluate(self, step: int, metrics: dict) -> str | None:
        value = self.value(metrics)
        if self.improved(value):
            self.best, self.waited = value, 0
            return None
        self.waited += 1
        if self.waited < self.patience:
            return None
        return (
            f"early stopping: {self.metric} {value:.4g} did not improve on {self.best:.4g} by more than "
            f"{self.min_delta:g} ({self.mode}) in {self.waited} evaluations"
        )


def make_callback(name: str, options: dict | None = None, key: str = "output.callbacks") -> Any:
    """Return the callback `name` built with `options`: polo's own class (EarlyStopping) or a user's `module:Name`."""
    module_name, _, class_name = name.rpartition(":")
    if module_name:
        source = import_user_module(module_name, key)
    else:
        import polo.runtime.callbacks as source  # polo's own callbacks are the classes of this module
    factory = getattr(source, class_name, None)
    if not callable(factory) or (not module_name and not (isinstance(factory, type) and issubclass(factory, Callback))):
        where = f"module {module_name!r} has" if module_name else "polo has"
        raise ConfigError(f"{key}: {where} no callback class {class_name!r} (polo's own: EarlyStopping)")
    try:
        return factory(**(options or {}))
    except TypeError as error:
        raise ConfigError(f"{key}: {name} does not take these options {sorted(options or {})}: {error}") from None


def run_callbacks(config: Any, given: list | tuple | None = None) -> list:
    """Return the callbacks of a run: those its recipe's `output.callbacks` names, then the Python objects `given`."""
    specs = getattr(getattr(config, "output", None), "callbacks", None) or []
    built = [make_callback(spec.name, spec.options, f"output.callbacks[{index}]") for index, spec in enumerate(specs)]
    return built + list(given or [])
