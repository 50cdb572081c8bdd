"""The one run lifecycle: every trainer (`polo train`, `sft`, `rm`, `dpo`, `control`, each pipeline stage) is a step
plugged into `run_lifecycle`, which does everything around it.

    lock <output.dir>                       polo.runtime.run_lock, before anything reads or writes there
    stop signals become requests            polo.runtime.interrupt
    build the trainer                       the caller's `open_trainer(rollback)`: config checked, resume
                                            point found (`resume_point`), models loaded, state restored,
                                            config.yaml written (`snapshot_config`)
    open the trackers; on_run_start         polo.runtime.metrics, polo.runtime.callbacks
    evaluate before the first step          (abandoned at once by a stop signal: nothing to save yet)
    each step:  step -> judge -> log -> on_step_end -> evaluate every N -> checkpoint every N
                (a stop signal: checkpoint, then `RunStopped`; a divergence: `Rollback`, rebuilt
                from the last checkpoint by `open_trainer`; a callback's reason: the run ends there)
    evaluate after the last step, the final checkpoint, close the trackers
    finish (plots, model card, upload: the trainer's); on_run_end

A *trainer* (`Trainer`) is what differs between commands: one step, one evaluation, its checkpoint
and what a finished run leaves. Everything in the list above is written once, here; the
architecture test fails when another module opens a `MetricsLogger` or loops over training steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from polo.runtime import parallel
from polo.runtime.callbacks import RunInfo
from polo.runtime.checkpoint import Checkpointer
from polo.runtime.interrupt import Abandoned, RunStopped, StopRequest, print_now
from polo.runtime.metrics import MetricsLogger
from polo.runtime.parallel import is_main_process
from polo.runtime.resume import (
    CHANGES_FILE,
    RECIPE_FILE,
    Change,
    changed_keys,
    check_changes,
    check_command,
    damaged_line,
    forget_changes_from,
    newest_intact,
    recipe_text,
    record_changes,
    saved_recipe,
    set_aside,
    step_of,
)
from polo.runtime.run_lock import owned_run_dir
from polo.runtime.trackers import Trackers

SAVE_PLAN = "stopping after this step and saving a checkpoint"


@dataclass
class StepReport:
    """What one step returns: its metrics row (None: nothing to log this step) and what goes beside it."""

    metrics: dict | None
    samples: list[dict] = field(default_factory=list)  # rows for samples.jsonl (each holds "step")
    completions: list[dict] | None = None  # a tracker's completions table
    messages: list[str] = field(default_factory=list)  # lines written before the row
    summary: dict = field(default_factory=dict)  # the progress bar's fields
    position: int | None = None  # the progress bar's position (None: the step)


@dataclass
class Evaluation:
    """A held-out evaluation: what the trainer keeps (`result`), the row it logs (`eval/...` keys), and its line."""

    result: dict
    row: dict
    line: str


@dataclass(frozen=True)
class Cadence:
    """When the lifecycle evaluates and checkpoints, and how long the run is."""

    total_steps: int  # the last step (or, with `Trainer.finished`, the progress bar's length)
    save_every: int = 0  # checkpoint every N steps (0: only on a stop signal, and at the end when `final_checkpoint`)
    eval_before: bool = False
    eval_every: int = 0
    eval_after: bool = False
    final_checkpoint: bool = False  # the last step is saved as a checkpoint (polo train's final model)
    resumable: bool = True  # a stopped run continues from its checkpoint (False: it writes none)
    progress: bool = True


@dataclass
class Ending:
    """How the loop ended: the last step taken, the held-out result after it, and whether a callback stopped it."""

    last_step: int
    eval_after: dict | None
    stopped_by: str | None = None  # a callback's reason


class Trainer(Protocol):
    """One command's training, as the lifecycle drives it: a trainer is its step and what surrounds it."""

    name: str  # "polo sft", ...
    output_dir: Path | None  # None: the run writes nothing
    cadence: Cadence
    trackers: Trackers
    start_step: int  # 0, or the step of the checkpoint it resumed from
    eval_before: dict | None  # the held-out result before training (kept in checkpoints)

    def banner(self) -> str:
        """Return the run's first log line."""

    def finished(self, step: int) -> bool:
        """Return True when step `step` was the last (`step >= cadence.total_steps` for most trainers)."""

    def step(self, step: int) -> StepReport:
        """Take step `step` and return its report."""

    def judge(self, step: int, metrics: dict) -> str | None:
        """Return why step `step` diverged (None: accepted), before its row is logged; may add keys to `metrics`."""

    def rollback(self, step: int, reason: str) -> Any:
        """Return where to roll back to after `reason` (given to `open_trainer`; it has `.message`), or raise."""

    def evaluate(self, step: int) -> Evaluation | None:
        """Return the held-out evaluation at `step` (None: there is nothing held out)."""

    def save(self, step: int) -> Path | None:
        """Write checkpoint `step` (every rank calls it) and return its path (None off the main process)."""

    def latest_checkpoint(self) -> Path | None:
        """Return the newest complete checkpoint (None: none yet)."""

    def finish(self, ending: Ending) -> Any:
        """Return the run's result after its final files (plots, model card, upload) are written."""


class Rollback(Exception):
    """Raised by the loop to rebuild the trainer from an earlier state (`state`, which has a `.message`)."""

    def __init__(self, state: Any):
        super().__init__(state.message)
        self.state = state


def say_on_main(line: str) -> None:
    """Print `line` on the main process only (every rank of a torchrun job gets the scheduler's signal)."""
    if is_main_process():
        print_now(line)


def run_lifecycle(
    open_trainer: Callable[[Any], Trainer],
    output_dir: Path | str | None,
    callbacks: Sequence = (),
    stop_plan: str = SAVE_PLAN,
) -> Any:
    """Return the result of a whole run of the trainer that `open_trainer(None)` builds, holding `output_dir`.

    `open_trainer(rollback)` builds (or, after a divergence, rebuilds from `rollback`) the trainer;
    it runs with the directory locked and stop signals held as requests. `output_dir` None: the run
    writes nothing and takes no lock (benchmarks). `callbacks` follow `polo.runtime.callbacks`.
    """
    with held(output_dir), StopRequest(say_on_main, stop_plan):
        rollback = None
        while True:  # once, unless a divergence rolls the run back
            try:
                return Lifecycle(open_trainer(rollback), callbacks, stop_plan).run()
            except Rollback as request:
                rollback = request.state  # the failed run's frames go with the exception, before the rebuild
            say_on_main(rollback.message)


@contextmanager
def held(output_dir: Path | str | None) -> Iterator[None]:
    """Hold `output_dir` against a second run for the duration (nothing to hold for a run that writes nothing)."""
    if output_dir is None:
        yield
        return
    with owned_run_dir(output_dir):
        yield


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: the checkpoint it continues from (None: a fresh run) and the recipe changes it allows."""

    checkpoint: Path | None = None
    changes: tuple[Change, ...] = ()


def resume_point(
    checkpointer: Checkpointer,
    command: str,
    output: Any,
    recipe: dict,
    keys: Sequence[str],
    finished: Callable[[Path], Exception | None] | None = None,
) -> ResumePoint:
    """Return where a run starts, from files alone: the one place every command decides it (`polo.runtime.resume`).

    `output` is the recipe's output section (`dir`, `resume`, `allow_changes`); `recipe` the run's
    config as a mapping, `keys` those of its keys that say what the run is. With `output.resume`:
    a damaged newest checkpoint is named in one line and set aside for the newest intact one; a
    checkpoint another command wrote is refused; `finished(checkpoint)` may say there is nothing
    left to do (raised); a change to one of `keys` is refused in one line naming it and both
    values unless `output.allow_changes` names it. A fresh run's claim on the directory is the
    caller's (`claim_output_dir`), once what could fail cheaply has.
    """
    if not output.resume:
        return ResumePoint()
    checkpoint, damaged = newest_intact(checkpointer.root)
    parallel.barrier()  # every rank has looked before the main process moves anything
    if is_main_process():
        for each in damaged:
            print(damaged_line(each, checkpoint), flush=True)
            set_aside(each)
    parallel.barrier()
    if checkpoint is None:
        say_on_main(f"polo: resume=true but no checkpoint in {checkpointer.root}; starting from step 0")
        return ResumePoint()
    check_command(checkpoint, command)
    done = finished(checkpoint) if finished is not None else None
    if done is not None:
        raise done
    saved = saved_recipe(checkpoint, Path(output.dir)) or {}
    changes = changed_keys(saved, recipe, keys)
    allowed = check_changes(changes, output.allow_changes, checkpoint, "output.allow_changes")
    if allowed:
        say_on_main(
            f"polo: resuming from {checkpoint.name} with {', '.join(map(str, allowed))}, as output.allow_changes "
            f"allows (recorded in {CHANGES_FILE})"
        )
    return ResumePoint(checkpoint, tuple(allowed))


def snapshot_config(output_dir: Path, config: dict, note: str = "", resumed: ResumePoint | None = None) -> None:
    """Write `<output_dir>/config.yaml` (main process): the run's configuration as it started (after `note`, comment
    lines).

    With `resumed` (a resume, not a rollback) the changes it allows are recorded in
    config_changes.jsonl from its checkpoint's step on, replacing those an earlier try at the same
    steps recorded; config.yaml keeps each changed key's starting value with a comment line per
    change (`polo.runtime.resume.recipe_text`).
    """
    if not is_main_process():
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    if resumed is not None and resumed.checkpoint is not None:
        step = step_of(resumed.checkpoint)
        forget_changes_from(output_dir, step)
        record_changes(output_dir, step, list(resumed.changes))
    (output_dir / RECIPE_FILE).write_text(note + recipe_text(config, output_dir))


class QuietLog:
    """The logger of a run that writes nothing: every call does nothing."""

    def log(self, row: dict) -> None: ...

    def write(self, message: str) -> None: ...

    def log_samples(self, rows: list[dict]) -> None: ...

    def log_completions(self, step: int, rows: list[dict]) -> None: ...

    def advance(self, step: int, summary: dict) -> None: ...

    def close(self) -> None: ...


class Lifecycle:
    """One pass of the loop over a built trainer: what `run_lifecycle` runs until the end, a stop or a rollback."""

    def __init__(self, trainer: Trainer, callbacks: Sequence, stop_plan: str = SAVE_PLAN):
        self.trainer, self.callbacks, self.stop_plan = trainer, list(callbacks), stop_plan
        self.cadence = trainer.cadence
        self.saved_step = trainer.start_step
        self.last_eval: tuple[int, Evaluation] | None = None
        self.logger: MetricsLogger | QuietLog = QuietLog()

    def run(self) -> Any:
        """Return the trainer's result after the whole loop; the trackers are closed however it ends."""
        trainer, cadence = self.trainer, self.cadence
        if trainer.output_dir is not None:
            self.logger = MetricsLogger(
                trainer.output_dir, cadence.total_steps, trainer.start_step, cadence.progress, trainer.trackers
            )
        try:
            self.logger.write(trainer.banner())
            info = RunInfo(trainer.name, trainer.output_dir, trainer.start_step, cadence.total_steps)
            self.call("on_run_start", info)
            with StopRequest(self.logger.write, self.stop_plan) as stop:
                if trainer.eval_before is None and cadence.eval_before:
                    trainer.eval_before = self.evaluate_or_stop(stop, trainer.start_step)
                if parallel.any_rank(stop.requested):  # a signal during set-up: nothing trained since the checkpoint
                    raise RunStopped(stop.signum, trainer.start_step, trainer.latest_checkpoint(), cadence.resumable)
                ending = self.loop(stop)
                self.end(stop, ending)
        finally:
            self.logger.close()
        result = trainer.finish(ending)
        self.call("on_run_end", result)
        return result

    def loop(self, stop: StopRequest) -> Ending:
        """Take the steps after `start_step` until the last, a stop signal (`RunStopped`) or a callback's reason."""
        trainer, cadence = self.trainer, self.cadence
        step, path = trainer.start_step, None
        while not trainer.finished(step):
            step += 1
            report = trainer.step(step)
            diverged = trainer.judge(step, report.metrics) if report.metrics is not None else None
            row = self.log_step(step, report)
            if diverged:
                raise Rollback(trainer.rollback(step, diverged))
            reason = self.call("on_step_end", step, row or {})
            if cadence.eval_every and step % cadence.eval_every == 0 and not trainer.finished(step):
                reason = self.evaluate(step) or reason
            stopping = parallel.any_rank(stop.requested)  # every rank stops after the same step
            if (cadence.save_every and step % cadence.save_every == 0) or (stopping and cadence.resumable):
                path = self.save(step)
                stopping = stopping or parallel.any_rank(stop.requested)  # a signal during the save: stop on it
            if stopping:
                raise RunStopped(stop.signum, step, path if cadence.resumable else None, cadence.resumable)
            if self.callbacks and parallel.any_rank(reason is not None):
                self.logger.write(f"polo: stopping after step {step}: {reason}")
                return Ending(step, None, reason)
        return Ending(step, None)

    def end(self, stop: StopRequest, ending: Ending) -> None:
        """Evaluate after the last step and write the final checkpoint, filling `ending.eval_after`."""
        trainer, cadence, last = self.trainer, self.cadence, ending.last_step
        if self.last_eval is not None and self.last_eval[0] == last:  # a callback stopped on this evaluation
            ending.eval_after = self.last_eval[1].result
        elif cadence.eval_after:
            try:
                ending.eval_after = self.evaluate_or_stop(stop, last)
            except RunStopped as stopped:
                if cadence.resumable and last > self.saved_step:  # the steps since the last save are kept
                    raise RunStopped(stopped.signum, last, self.save(last), cadence.resumable) from None
                raise
        if cadence.final_checkpoint and (
            last > self.saved_step or parallel.any_rank(trainer.latest_checkpoint() is None)
        ):
            self.save(last)

    def log_step(self, step: int, report: StepReport) -> dict | None:
        """Write the step's messages, metrics row (returned, with "step"), sample rows and table; advance the bar."""
        logger = self.logger
        for message in report.messages:
            logger.write(message)
        if report.metrics is None:
            return None
        row = {**report.metrics}
        row.setdefault("step", step)
        logger.log(row)
        logger.log_samples(report.samples)
        if report.completions is not None:
            logger.log_completions(step, report.completions)
        logger.advance(step if report.position is None else report.position, report.summary)
        return row

    def evaluate(self, step: int) -> str | None:
        """Evaluate at `step`: log its row and line, tell the callbacks; return a callback's reason to stop."""
        evaluation = self.trainer.evaluate(step)
        if evaluation is None:
            return None
        self.last_eval = (step, evaluation)
        row = {"step": step, **evaluation.row}
        self.logger.log(row)
        self.logger.write(evaluation.line)
        return self.call("on_evaluate", step, row)

    def evaluate_or_stop(self, stop: StopRequest, step: int) -> dict | None:
        """Return the held-out result at `step` (before the first step or after the last), dropped at once by a stop
        signal (`RunStopped`: there is nothing new to save, or the caller saves it)."""
        try:
            with stop.abandoning(f"stopping now: the held-out evaluation at step {step} is abandoned"):
                self.evaluate(step)
        except Abandoned as abandoned:
            raise RunStopped(abandoned.signum, step, self.trainer.latest_checkpoint(), self.cadence.resumable) from None
        return self.last_eval[1].result if self.last_eval is not None and self.last_eval[0] == step else None

    def save(self, step: int) -> Path | None:
        """Write checkpoint `step` and tell the callbacks; return its path."""
        path, self.saved_step = self.trainer.save(step), step
        self.call("on_checkpoint", step, path)
        return path

    def call(self, hook: str, *args: Any) -> str | None:
        """Call `hook` on every callback that has it; return the first reason to stop one gave (None: go on)."""
        reasons = [getattr(callback, hook)(*args) for callback in self.callbacks if hasattr(callback, hook)]
        return next((reason for reason in reasons if reason), None)
