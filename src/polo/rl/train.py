"""The language-model RL loop: GRPO and its relatives are presets of this one loop.

    run = set_up(config)                                   polo.rl.setup
    for step:  sample -> score -> advantages -> update     polo.rl.step, polo.rl.update
               log -> (evaluate) -> checkpoint             polo.runtime, polo.evaluation

All the maths is in `polo.core`; the algorithm's parts are looked up by name in its registries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from polo.config import Config, config_to_dict, load_config
from polo.evaluation.evaluate import greedy_accuracy
from polo.evaluation.plots import plot_run
from polo.generation.grouped import GroupSampling
from polo.kernels import fast_path_fallbacks
from polo.models.loading import recompute_above
from polo.models.lora import trainable_summary
from polo.rl.guard import DivergenceGuard, Rollback, RollbackState
from polo.rl.publish import publish_model
from polo.rl.setup import Run, set_up
from polo.rl.step import StepResult, rl_step, sampling_weights
from polo.runtime import parallel
from polo.runtime.device import resolve_device, torch_threads
from polo.runtime.errors import NonFiniteLossError
from polo.runtime.interrupt import RunStopped, StopRequest
from polo.runtime.metrics import MetricsLogger, read_metrics
from polo.runtime.parallel import is_main_process
from polo.runtime.resume import RunFinishedError
from polo.runtime.run_lock import owned_run_dir
from polo.runtime.trackers import Trackers


@dataclass
class TrainResult:
    """What a finished run returns to a notebook caller."""

    output_dir: Path
    steps: int
    eval_before: dict | None = None
    eval_after: dict | None = None
    metrics: list[dict] = field(default_factory=list)


def train(
    config: Config | str | Path | dict | None = None,
    overrides: list[str] | None = None,
    *,
    reward_functions: dict | None = None,
    train_dataset: object = None,
    eval_dataset: object = None,
) -> TrainResult:
    """Train a causal LM with the configured policy-optimization algorithm and return the result.

    `config` is a `Config`, a recipe path or a mapping; `overrides` are `dotted.key=value`
    strings. `reward_functions` maps extra callables to weights, added to the configured rewards:
    polo's `(completion, row) -> float` or TRL's `(prompts, completions, completion_ids, **columns)`
    (`polo.rewards.forms`). `train_dataset` / `eval_dataset` (a `datasets.Dataset` or a
    list of dicts) are the rows of the hf task (`polo.data.hf`; a resume needs the same ones again).
    Launched by `torchrun`, every process calls it and the run is data-parallel (see
    `polo.runtime.parallel`); the process group is joined and left here.
    """
    if not isinstance(config, Config) or overrides:  # read once, here: the process group's backend follows train.device
        config, overrides = (
            load_config(config_to_dict(config) if isinstance(config, Config) else config, overrides),
            None,
        )
    if config.train.steps == 0:  # nothing to train: no model loads and output.dir stays as it is
        say_on_main(f"polo: train.steps=0: nothing to train; nothing was loaded, and {config.output.dir} is untouched")
        return TrainResult(Path(config.output.dir), 0)
    joined, finished = parallel.init_from_environment(resolve_device(config.train.device)), False
    try:
        # The lock comes before anything looks at output.dir; a stop signal during set-up is held until the loop
        # can stop cleanly.
        with owned_run_dir(config.output.dir), StopRequest(say_on_main), torch_threads(config.train.threads):
            rollback = None
            while True:  # once, unless the divergence guard rolls the run back (polo.rl.guard)
                try:
                    result = train_loop(
                        set_up(
                            config,
                            overrides,
                            reward_functions,
                            rollback=rollback,
                            train_dataset=train_dataset,
                            eval_dataset=eval_dataset,
                        )
                    )
                    finished = True
                    return result
                except RunFinishedError as done:  # resumed after its end: say so, evaluate and save nothing again
                    say_on_main(str(done))
                    finished = True
                    return finished_result(config)
                except Rollback as request:
                    rollback = request.state  # the failed run's frames go with the exception, before the rebuild
                if is_main_process():
                    print(rollback.message, flush=True)
    finally:
        if joined:
            parallel.leave_process_group(finished)


def train_loop(run: Run) -> TrainResult:
    """Run steps `run.start_step + 1 ... train.steps`: sample, score, update, log, evaluate, checkpoint."""
    config = run.config
    logger = MetricsLogger(
        run.output_dir, config.train.steps, run.start_step, config.output.progress, trackers=Trackers.of(config)
    )
    logger.write(banner(run))
    evaluate = HeldOutEvaluation(run, logger)
    if run.eval_before is None and config.eval.before and run.task.eval_rows:
        run.eval_before = evaluate(0)

    saved_step, nonfinite_streak = run.start_step, 0
    guard = DivergenceGuard(run.model, config, run.checkpointer)
    with StopRequest(logger.write) as stop:
        if parallel.any_rank(stop.requested):  # a signal during set-up: nothing was trained since the last checkpoint
            logger.close()
            raise RunStopped(stop.signum, run.start_step, run.checkpointer.latest())
        for step in range(run.start_step + 1, config.train.steps + 1):
            try:
                result = rl_step(run, step)
                nonfinite_streak = 0
            except NonFiniteLossError as error:  # the update was not applied: skip the step, or stop after too many
                nonfinite_streak = skip_or_stop(run, logger, step, nonfinite_streak + 1, error)
                result = StepResult({"skipped_nonfinite": 1.0})
            diverged = guard.judge(step, result.metrics)  # before anything could evaluate or save the step's weights
            if run.rollbacks:
                result.metrics["rollbacks"] = run.rollbacks
            log_step(logger, step, result)
            if diverged:
                logger.close()
                raise Rollback(
                    guard.rollback_or_stop(
                        step, diverged, RollbackState(run.data_offset, run.rollbacks, run.eval_before), config
                    )
                )
            if config.eval.every and step % config.eval.every == 0 and step != config.train.steps:
                evaluate(step)
            stopping = parallel.any_rank(stop.requested)  # every rank stops after the same step
            if (config.output.save_every and step % config.output.save_every == 0) or stopping:
                path, saved_step = run.save(step), step
                stopping = stopping or parallel.any_rank(
                    stop.requested
                )  # a signal during the save: stop on the checkpoint just written
            if stopping:
                logger.close()
                raise RunStopped(stop.signum, step, path)

    eval_after = evaluate(config.train.steps) if config.eval.after and run.task.eval_rows else None
    if config.train.steps > saved_step or parallel.any_rank(run.checkpointer.latest() is None):
        run.save(config.train.steps)
    logger.close()
    if is_main_process() and config.output.plots:
        plot_run(run.output_dir)
    publish_model(
        run, eval_after
    )  # README.md into the final checkpoint; the upload of output.push_to_hub (main process)
    return TrainResult(
        run.output_dir, config.train.steps, run.eval_before, eval_after, read_metrics(run.output_dir / "metrics.jsonl")
    )


def finished_result(config: Config) -> TrainResult:
    """Return what a finished run in `output.dir` left: its metrics and held-out results, read from its files."""
    output_dir, steps = Path(config.output.dir), config.train.steps
    evaluations = [output_dir / f"eval_step{step:06d}.json" for step in (0, steps)]
    before, after = (json.loads(path.read_text()) if path.is_file() else None for path in evaluations)
    return TrainResult(output_dir, steps, before, after, read_metrics(output_dir / "metrics.jsonl"))


def say_on_main(line: str) -> None:
    """Print `line` on the main process only (every rank of a torchrun job gets the scheduler's signal)."""
    if is_main_process():
        print(line, flush=True)


def banner(run: Run) -> str:
    """Return the run's first log line: algorithm, task, model, compute (precision on device), batch shape and steps."""
    config, alg = run.config, run.config.algorithm
    lora = config.model.lora
    adapters = f" | LoRA r={lora.r}: {trainable_summary(run.model)}" if lora.r else ""
    above = recompute_above(run.model)
    recompute = f" | activations recomputed above {above:,} tokens a micro-batch" if above is not None else ""
    fallbacks = fast_path_fallbacks(run.model, run.compute)  # the same maths, slower: said once, here
    fallback = f" | fallbacks: {fallbacks}" if fallbacks else ""
    return (
        f"polo: {alg.name} on {run.task.name} | model {config.model.name} | {run.compute} | "
        f"{config.train.prompts_per_step} prompts x {alg.group_size} completions | "
        f"steps {run.start_step}->{config.train.steps}" + recompute + adapters + fallback
    )


def log_step(logger: MetricsLogger, step: int, result: StepResult) -> None:
    """Write the step's messages, metrics row, sample rows and completions table, and advance the progress bar."""
    for message in result.messages:
        logger.write(message)
    metrics = {**result.metrics, "step": step}
    logger.log(metrics)
    logger.log_samples(result.samples)
    logger.log_completions(step, result.completions)
    summary = {"reward": "reward/mean", "acc": "accuracy", "len": "completion_length/mean"}
    logger.advance(step, {label: metrics.get(key, float("nan")) for label, key in summary.items()})


def skip_or_stop(run: Run, logger: MetricsLogger, step: int, streak: int, error: NonFiniteLossError) -> int:
    """Return the new non-finite streak after warning that `step` was skipped; raise once it reaches the limit."""
    limit = run.config.train.max_nonfinite_steps
    if streak >= limit:
        logger.close()
        latest = run.checkpointer.latest()  # every saved step passed the divergence guard: its weights are good
        kept = (
            f"the last good checkpoint is {latest}"
            if latest is not None
            else f"no checkpoint was written yet and the starting model {run.config.model.name} is untouched"
        )
        raise NonFiniteLossError(
            f"{streak} steps in a row had a non-finite loss, stopping at step {step} "
            f"(train.max_nonfinite_steps={limit}); {kept}. Last error: {error}"
        ) from error
    logger.write(f"polo: warning: step {step} skipped: {error}")
    return streak


# Held-out tool use of an environment's episodes (`polo.generation.episodes.episode_metrics`), logged as
# eval/tool/<key>.
TOOL_EVAL_KEYS = ("calls_per_episode", "call_success_rate", "turns", "episodes_with_calls", "used_by_correct")


class HeldOutEvaluation:
    """Greedy accuracy on the task's held-out rows, each rank decoding its share; logged and saved per step."""

    def __init__(self, run: Run, logger: MetricsLogger):
        self.run, self.logger = run, logger
        self.rows = parallel.eval_share(run.task.eval_rows)
        self.prompts = run.task.prompts(run.tokenizer, self.rows, run.instruction, run.config.task.system_prompt)
        self.sampling = GroupSampling(
            max_new_tokens=run.config.eval_max_new_tokens,
            batch_size=run.config.eval.batch_size,
            compute=run.compute,
            sampler=run.sampler,
        )

    def __call__(self, step: int) -> dict:
        """Return the held-out result at `step` (combined over ranks), logged and written to eval_stepNNNNNN.json."""
        run = self.run
        with sampling_weights(run.model) as sampler:
            result = (
                greedy_accuracy(sampler, run.tokenizer, self.prompts, self.rows, run.task.correctness, self.sampling)
                if self.rows
                else None
            )
        result = combine_eval(parallel.gather_objects((len(self.rows), result)))
        self.logger.log(
            {
                "step": step,
                "eval/accuracy": result["accuracy"],
                "eval/completion_length": result["completion_length"],
                "eval/truncated": result["truncated"],
                **{f"eval/tool/{key}": result[key] for key in TOOL_EVAL_KEYS if key in result},
            }
        )
        self.logger.write(
            f"step {step}: held-out greedy accuracy {result['accuracy']:.3f} on {len(run.task.eval_rows)} problems"
        )
        if is_main_process():
            (run.output_dir / f"eval_step{step:06d}.json").write_text(json.dumps(result, indent=1))
        return result


def combine_eval(per_rank: list[tuple[int, dict | None]]) -> dict:
    """Return one greedy-evaluation result from each rank's `(problems, result)` (weighted by problems)."""
    total = sum(count for count, _ in per_rank) or 1
    parts = [(count, result) for count, result in per_rank if result is not None]
    if len(parts) == 1:
        return parts[0][1]
    keys = ("accuracy", "completion_length", "truncated", *(key for key in TOOL_EVAL_KEYS if key in parts[0][1]))
    combined = {key: sum(count * result[key] for count, result in parts) / total for key in keys}
    return {**combined, "samples": parts[0][1]["samples"]}
