"""The language-model RL trainer: GRPO and its relatives are presets of this one step.

    run = set_up(config)                                   polo.rl.setup
    each step:  sample -> score -> advantages -> update    polo.rl.step, polo.rl.update
    around it:  log, evaluate, checkpoint, stop, publish   polo.runtime.lifecycle

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
from polo.rl.guard import DivergenceGuard, RollbackState
from polo.rl.publish import publish_model
from polo.rl.setup import Run, set_up
from polo.rl.step import StepResult, rl_step, sampling_weights
from polo.runtime import parallel
from polo.runtime.callbacks import run_callbacks
from polo.runtime.device import resolve_device, torch_threads
from polo.runtime.errors import NonFiniteLossError
from polo.runtime.lifecycle import Cadence, Ending, Evaluation, StepReport, run_lifecycle
from polo.runtime.metrics import read_metrics
from polo.runtime.parallel import is_main_process
from polo.runtime.resume import RunFinishedError
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
    callbacks: list | None = None,
) -> TrainResult:
    """Train a causal LM with the configured policy-optimization algorithm and return the result.

    `config` is a `Config`, a recipe path or a mapping; `overrides` are `dotted.key=value`
    strings. `reward_functions` maps extra callables to weights, added to the configured rewards:
    polo's `(completion, row) -> float` or TRL's `(prompts, completions, completion_ids, **columns)`
    (`polo.rewards.forms`). `train_dataset` / `eval_dataset` (a `datasets.Dataset` or a
    list of dicts) are the rows of the hf task (`polo.data.hf`; a resume needs the same ones again).
    `callbacks` are called at the run's start, each step, evaluation and checkpoint, and its end
    (`polo.runtime.callbacks`; after those `output.callbacks` names).
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

        def open_trainer(rollback: RollbackState | None) -> RLTrainer:
            return RLTrainer(
                set_up(
                    config,
                    overrides,
                    reward_functions,
                    rollback=rollback,
                    train_dataset=train_dataset,
                    eval_dataset=eval_dataset,
                )
            )

        try:
            with torch_threads(config.train.threads):  # the caller's thread count comes back after the run
                result = run_lifecycle(open_trainer, config.output.dir, run_callbacks(config, callbacks))
        except RunFinishedError as done:  # resumed after its end: say so, evaluate and save nothing again
            say_on_main(str(done))
            result = finished_result(config)
        finished = True
        return result
    finally:
        if joined:
            parallel.leave_process_group(finished)


class RLTrainer:
    """An RL run as the lifecycle drives it (`polo.runtime.lifecycle.Trainer`): `rl_step` and what surrounds it."""

    name = "polo train"

    def __init__(self, run: Run):
        config = run.config
        self.run, self.output_dir, self.trackers = run, run.output_dir, Trackers.of(config)
        held_out = bool(run.task.eval_rows)
        self.cadence = Cadence(
            total_steps=config.train.steps,
            save_every=config.output.save_every,
            eval_before=config.eval.before and held_out,
            eval_every=config.eval.every,
            eval_after=config.eval.after and held_out,
            final_checkpoint=True,
            progress=config.output.progress,
        )
        self.held_out = HeldOutEvaluation(run)
        self.guard = DivergenceGuard(run.model, config, run.checkpointer)
        self.nonfinite_streak = 0

    @property
    def start_step(self) -> int:
        return self.run.start_step

    @property
    def eval_before(self) -> dict | None:
        return self.run.eval_before

    @eval_before.setter
    def eval_before(self, result: dict | None) -> None:
        self.run.eval_before = result

    def banner(self) -> str:
        return banner(self.run)

    def finished(self, step: int) -> bool:
        return step >= self.run.config.train.steps

    def step(self, step: int) -> StepReport:
        """Return step `step`'s report; a non-finite loss skips the step (its update was not applied)."""
        messages = []
        try:
            result = rl_step(self.run, step)
            self.nonfinite_streak = 0
        except NonFiniteLossError as error:  # skip the step, or stop after too many
            self.nonfinite_streak = skip_or_stop(self.run, step, self.nonfinite_streak + 1, error)
            messages.append(f"polo: warning: step {step} skipped: {error}")
            result = StepResult({"skipped_nonfinite": 1.0})
        summary = {"reward": "reward/mean", "acc": "accuracy", "len": "completion_length/mean"}
        return StepReport(
            result.metrics,
            result.samples,
            result.completions,
            messages + result.messages,
            {label: result.metrics.get(key, float("nan")) for label, key in summary.items()},
        )

    def judge(self, step: int, metrics: dict) -> str | None:
        """Return why the step diverged (`polo.rl.guard`), before anything could evaluate or save its weights."""
        diverged = self.guard.judge(step, metrics)
        if self.run.rollbacks:
            metrics["rollbacks"] = self.run.rollbacks
        return diverged

    def rollback(self, step: int, reason: str) -> RollbackState:
        run = self.run
        state = RollbackState(run.data_offset, run.rollbacks, run.eval_before)
        return self.guard.rollback_or_stop(step, reason, state, run.config)

    def evaluate(self, step: int) -> Evaluation:
        return self.held_out(step)

    def save(self, step: int) -> Path | None:
        return self.run.save(step)

    def latest_checkpoint(self) -> Path | None:
        return self.run.checkpointer.latest()

    def finish(self, ending: Ending) -> TrainResult:
        """Draw the plots, write the model card into the final checkpoint (and upload it); return the result."""
        run = self.run
        if is_main_process() and run.config.output.plots:
            plot_run(run.output_dir)
        publish_model(run, ending.eval_after)  # README.md into the final checkpoint; output.push_to_hub's upload
        metrics = read_metrics(run.output_dir / "metrics.jsonl")
        return TrainResult(run.output_dir, ending.last_step, run.eval_before, ending.eval_after, metrics)


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


def skip_or_stop(run: Run, step: int, streak: int, error: NonFiniteLossError) -> int:
    """Return the new non-finite streak after step `step` failed with `error`; raise once it reaches the limit."""
    limit = run.config.train.max_nonfinite_steps
    if streak >= limit:
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
    return streak


# Held-out tool use of an environment's episodes (`polo.generation.episodes.episode_metrics`), logged as
# eval/tool/<key>.
TOOL_EVAL_KEYS = ("calls_per_episode", "call_success_rate", "turns", "episodes_with_calls", "used_by_correct")


class HeldOutEvaluation:
    """Greedy accuracy on the task's held-out rows, each rank decoding its share; saved per step."""

    def __init__(self, run: Run):
        self.run = run
        self.rows = parallel.eval_share(run.task.eval_rows)
        self.prompts = run.task.prompts(run.tokenizer, self.rows, run.instruction, run.config.task.system_prompt)
        self.sampling = GroupSampling(
            max_new_tokens=run.config.eval_max_new_tokens,
            batch_size=run.config.eval.batch_size,
            compute=run.compute,
            sampler=run.sampler,
        )

    def __call__(self, step: int) -> Evaluation:
        """Return the held-out evaluation at `step` (combined over ranks), written to eval_stepNNNNNN.json."""
        run = self.run
        with sampling_weights(run.model) as sampler:
            result = (
                greedy_accuracy(sampler, run.tokenizer, self.prompts, self.rows, run.task.correctness, self.sampling)
                if self.rows
                else None
            )
        result = combine_eval(parallel.gather_objects((len(self.rows), result)))
        row = {
            "eval/accuracy": result["accuracy"],
            "eval/completion_length": result["completion_length"],
            "eval/truncated": result["truncated"],
            **{f"eval/tool/{key}": result[key] for key in TOOL_EVAL_KEYS if key in result},
        }
        line = f"step {step}: held-out greedy accuracy {result['accuracy']:.3f} on {len(run.task.eval_rows)} problems"
        if is_main_process():
            (run.output_dir / f"eval_step{step:06d}.json").write_text(json.dumps(result, indent=1))
        return Evaluation(result, row, line)


def combine_eval(per_rank: list[tuple[int, dict | None]]) -> dict:
    """Return one greedy-evaluation result from each rank's `(problems, result)` (weighted by problems)."""
    total = sum(count for count, _ in per_rank) or 1
    parts = [(count, result) for count, result in per_rank if result is not None]
    if len(parts) == 1:
        return parts[0][1]
    keys = ("accuracy", "completion_length", "truncated", *(key for key in TOOL_EVAL_KEYS if key in parts[0][1]))
    combined = {key: sum(count * result[key] for count, result in parts) / total for key in keys}
    return {**combined, "samples": parts[0][1]["samples"]}
