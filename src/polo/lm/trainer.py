"""The language-model policy-optimization loop (GRPO and its relatives are presets of it).

One step: P prompts -> G sampled completions each -> rewards -> group advantages ->
(reference / old log-probs when needed) -> `update_epochs` passes of minibatch updates with
gradient accumulation -> metrics, progress, checkpoint. All the maths is in `polo.core`.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from polo import core
from polo.config import Config, ConfigError, config_to_dict, load_config
from polo.lm.critic import ValueModel, completion_values, logprobs_and_values, new_value_head
from polo.lm.evaluate import greedy_accuracy
from polo.lm import parallel
from polo.lm.attention import use_polo_attention
from polo.lm.lora import add_adapters, freeze_base_dtype, load_adapters, merged_for_sampling, reference_scope, trainable_summary
from polo.lm.precision import MasterWeights, mark_float32
from polo.lm.models import enable_activation_checkpointing, frozen_copy, load_policy, resolve_model_path
from polo.lm.rewards import RewardSet
from polo.lm.saving import staged_directory
from polo.lm.rollout import Rollouts, autocast_context, completion_logprobs, cpu_supports_bf16, rollout
from polo.lm.tasks import build_task
from polo.lm.tasks.base import DEFAULT_INSTRUCTION, PLAIN_INSTRUCTION, Task
from polo.logging import MetricsLogger, is_main_process, read_metrics, truncate_metrics


class StopRequest:
    """Turns the first Ctrl-C into a request to stop after the current step (and checkpoint).

    A second Ctrl-C interrupts at once. Outside the main thread signals cannot be caught and
    Ctrl-C behaves as usual.
    """

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.requested = False
        self.previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say("polo: stopping after this step and saving a checkpoint (Ctrl-C again to abort now)")

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the update was not applied."""


@dataclass
class TrainResult:
    """What a finished run returns to a notebook caller."""

    output_dir: Path
    steps: int
    eval_before: dict | None = None
    eval_after: dict | None = None
    metrics: list[dict] = field(default_factory=list)


# Which TaskConfig fields each built-in task takes.
TASK_OPTIONS = {
    "arithmetic": ("seed", "operators", "min_digits", "max_digits", "num_train", "num_eval", "answer_in_tags"),
    "gsm8k": ("train_path", "eval_path", "num_train", "num_eval", "answer_in_tags"),
    "jsonl": ("train_path", "eval_path", "prompt_field", "answer_field", "num_train", "num_eval", "answer_in_tags", "checker"),
    "code": ("num_train", "num_eval", "seed"),
}


def make_task(config: Config) -> Task:
    """Return the task the config names, built with the options that task understands."""
    task_config = config.task
    keys = TASK_OPTIONS.get(task_config.name, ())
    options = {key: getattr(task_config, key) for key in keys if getattr(task_config, key) is not None}
    return build_task(task_config.name, **options)


def instruction_for(config: Config, task: Task | None = None) -> str:
    """Return the prompt instruction template: the configured one, else the task's own, else the form's default."""
    if config.task.instruction is not None:
        return config.task.instruction
    if task is not None and task.instruction:
        return task.instruction
    return DEFAULT_INSTRUCTION if config.task.answer_in_tags else PLAIN_INSTRUCTION


def resolve_precision(precision: str) -> str:
    """Return "bf16" or "fp32" for a configured precision ("auto" picks bf16 where the CPU has it)."""
    if precision == "auto":
        return "bf16" if cpu_supports_bf16() else "fp32"
    return precision


def master_weights_unsupported(config: Config) -> str | None:
    """Return why `train.precision=bf16_master` cannot train this run (None when it can)."""
    if parallel.world_size() > 1:
        return f"it trains in one process only (this run has {parallel.world_size()})"
    if config.algorithm.advantage_estimator == "gae":
        return "PPO's critic is trained in fp32 weights (use train.precision=bf16)"
    return None


def resolve_train_precision(config: Config) -> str:
    """Return the policy trainer's precision: "fp32", "bf16" (autocast) or "bf16_master" (see polo.lm.precision).

    "auto" picks bf16_master where the CPU has native bf16 and the run allows it (one process,
    no critic), else bf16 autocast on such CPUs, else fp32.
    """
    precision = config.train.precision
    if precision == "auto":
        if not cpu_supports_bf16():
            return "fp32"
        return "bf16" if master_weights_unsupported(config) else "bf16_master"
    if precision == "bf16_master" and (reason := master_weights_unsupported(config)):
        raise ConfigError(f"train.precision=bf16_master: {reason}")
    return precision


def lr_lambda(config: Config) -> Callable[[int], float]:
    """Return the learning-rate multiplier as a function of optimizer step (linear warm-up, then the schedule)."""
    warmup = config.train.warmup_steps
    total = max(config.train.steps * config.train.num_minibatches * config.algorithm.update_epochs, 1)
    schedule = config.train.lr_schedule

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        shapes = {
            "constant": 1.0,
            "linear": 1.0 - progress,
            "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
        }
        return shapes[schedule]

    return multiplier


def batch_rows(rows: list[dict], step: int, prompts_per_step: int, seed: int, stream: int = 0) -> list[dict]:
    """Return the prompts for `step`: consecutive slices of a per-epoch shuffle, a pure function of step.

    Because the data position is derived from the step number, resuming needs no sampler state.
    `stream` > 0 gives independent extra draws for the same step (DAPO's extra sampling rounds).
    """
    picked = []
    start = step * prompts_per_step
    for position in range(start, start + prompts_per_step):
        epoch, index = divmod(position, len(rows))
        order = np.random.default_rng([seed, epoch] if stream == 0 else [seed, epoch, stream]).permutation(len(rows))
        picked.append(rows[int(order[index])])
    return picked


def trim_padding(rollouts: Rollouts) -> Rollouts:
    """Return the rollouts without columns that are padding in every row (less compute, same maths)."""
    prompt_keep = rollouts.prompt_mask.any(0).nonzero()
    prompt_start = int(prompt_keep[0]) if len(prompt_keep) else rollouts.prompt_mask.shape[1]
    completion_len = int(rollouts.completion_lengths.max()) if len(rollouts) else 0
    return Rollouts(
        prompt_ids=rollouts.prompt_ids[:, prompt_start:],
        prompt_mask=rollouts.prompt_mask[:, prompt_start:],
        completion_ids=rollouts.completion_ids[:, :completion_len],
        completion_mask=rollouts.completion_mask[:, :completion_len],
        truncated=rollouts.truncated,
        texts=rollouts.texts,
        group_size=rollouts.group_size,
    )


def micro_batches(rows: torch.Tensor, size: int, group_size: int = 1) -> list[torch.Tensor]:
    """Return `rows` (1-D indices) cut into consecutive chunks of at most `size`.

    With `group_size` > 1 and `size` >= group_size, `size` is rounded down to whole groups, so a
    chunk that starts at a group boundary holds whole groups (their prompt then runs once, see
    polo.lm.shared_prompt).
    """
    if group_size > 1 and size >= group_size:
        size -= size % group_size
    return [rows[start : start + size] for start in range(0, len(rows), size)]


@torch.no_grad()
def score_completions(model, rollouts: Rollouts, micro_batch_size: int, precision: str, temperature: float) -> torch.Tensor:
    """Return per-token log-probs of every completion under `model` (no gradient), (batch, completion_len)."""
    scored = torch.zeros(rollouts.completion_ids.shape, dtype=torch.float32)
    for rows in micro_batches(torch.arange(len(rollouts)), micro_batch_size, rollouts.group_size):
        part = trim_padding(rollouts.select(rows))
        with autocast_context(precision):
            logprobs, _ = completion_logprobs(
                model, part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask, temperature=temperature,
                group_size=rollouts.group_size,
            )
        scored[rows, : logprobs.shape[1]] = logprobs.float()
    return scored


class Checkpointer:
    """Saves and finds checkpoint directories `<dir>/checkpoints/step-NNNNNN`."""

    def __init__(self, output_dir: Path, keep: int):
        self.root = output_dir / "checkpoints"
        self.keep = keep

    def latest(self) -> Path | None:
        complete = [path for path in self.root.glob("step-*") if (path / "trainer_state.pt").exists()]
        return max(complete, key=lambda path: int(path.name.split("-")[1]), default=None)

    def save(self, step: int, model, tokenizer, optimizer, scheduler, extra: dict, masters: MasterWeights | None = None) -> Path | None:
        """Write checkpoint `step` from rank 0 (with every rank's RNG state) and return its path (None on other ranks).

        Every rank must call it: the RNG states are gathered, and no rank goes on before the
        checkpoint is whole. With `masters` (bf16_master) the fp32 master weights are saved.
        """
        rng_per_rank = parallel.gather_objects(rng_state())
        model_state, optimizer_state = parallel.full_state_dicts(model, optimizer)  # gathered whole under FSDP
        if masters is not None:
            model_state = masters.state_dict(model)
        target = None
        if is_main_process():
            extra = {**extra, "rng_per_rank": rng_per_rank}
            target = self._write(step, model, model_state, tokenizer, optimizer_state, scheduler, extra, fp32_masters=masters is not None)
        parallel.barrier()
        return target

    def _write(
        self, step: int, model, model_state: dict | None, tokenizer, optimizer_state: dict, scheduler, extra: dict, fp32_masters: bool = False,
    ) -> Path:
        target = self.root / f"step-{step:06d}"
        previous = self.latest()
        keeps = f"the last complete checkpoint {previous} is intact" if previous else "no checkpoint was written yet"
        with staged_directory(target, f"checkpoint step {step}", keeps) as staging:
            model.save_pretrained(str(staging), safe_serialization=True, state_dict=model_state)
            if fp32_masters and (staging / "config.json").exists():  # transformers writes the in-memory (bf16) dtype; the saved weights are the fp32 masters
                mark_float32(staging / "config.json")
            tokenizer.save_pretrained(str(staging))
            state = {
                "step": step,
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
                **extra,
            }
            torch.save(state, staging / "trainer_state.pt")  # last: a checkpoint is whole once this exists
        checkpoints = sorted(self.root.glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
        for old in checkpoints[: max(len(checkpoints) - self.keep, 0)]:
            shutil.rmtree(old)
        return target


def rng_state() -> dict:
    """Return this process's random-number-generator states (torch, numpy, python)."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def restore_rng(state: dict) -> None:
    """Set this process's random-number generators to a state from `rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(
    config: Config | str | Path | dict | None = None,
    overrides: list[str] | None = None,
    *,
    reward_functions: dict | None = None,
) -> TrainResult:
    """Train a causal LM with the configured policy-optimization algorithm and return the result.

    `config` is a `Config`, a recipe path or a mapping; `overrides` are `dotted.key=value`
    strings. `reward_functions` maps extra callables `(completion, row) -> float` to weights,
    added to the configured rewards. Launched by `torchrun`, every process calls it and the run
    is data-parallel (see `polo.lm.parallel`); the process group is joined and left here.
    """
    joined = parallel.init_from_environment()
    try:
        return _train(config, overrides, reward_functions)
    finally:
        if joined:
            torch.distributed.destroy_process_group()


def _train(config, overrides: list[str] | None, reward_functions: dict | None) -> TrainResult:
    if not isinstance(config, Config):
        config = load_config(config, overrides)
    elif overrides:
        config = load_config(config_to_dict(config), overrides)
    alg, train_config = config.algorithm, config.train
    if train_config.prompts_per_step % parallel.world_size():
        raise ConfigError(
            f"train.prompts_per_step={train_config.prompts_per_step} is not divisible by the {parallel.world_size()} processes; "
            f"pick a multiple of {parallel.world_size()} (each process samples whole groups)"
        )
    output_dir = Path(config.output.dir)
    precision = resolve_train_precision(config)
    if train_config.threads:
        torch.set_num_threads(train_config.threads)

    task = make_task(config)
    weights: dict = dict(config.rewards)
    weights.update(reward_functions or {})
    reward_set = RewardSet(weights, task, on_error=train_config.on_reward_error)
    instruction = instruction_for(config, task)

    checkpointer = Checkpointer(output_dir, config.output.keep_checkpoints)
    resume_from = checkpointer.latest() if config.output.resume else None
    if config.output.resume and resume_from is None and is_main_process():
        print(f"polo: resume=true but no checkpoint in {checkpointer.root}; starting from step 0")
    if resume_from is None and is_main_process():
        for old_log in ("metrics.jsonl", "samples.jsonl"):
            (output_dir / old_log).unlink(missing_ok=True)  # a fresh run must not mix with an old run's rows

    # Ranks sample different completions (seed + rank); they all start from the same weights.
    seed_everything(train_config.seed + parallel.rank())
    if parallel.rank() == 0:
        resolve_model_path(config.model.name)  # one process fetches/converts a built-in model, the others wait
    parallel.barrier()
    lora = config.model.lora
    # A LoRA checkpoint holds only the adapter: the base model comes from model.name again.
    start_from = str(resume_from) if resume_from is not None and not lora.r else config.model.name
    model, tokenizer = load_policy(start_from, attn_implementation=config.model.attn_implementation)
    model.train()
    if train_config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    reference = None
    if lora.r:
        model = load_adapters(model, resume_from) if resume_from is not None else add_adapters(model, lora)
        if precision == "bf16_master":
            freeze_base_dtype(model, torch.bfloat16)  # the base never changes: no master copy needed
        reference = model if alg.beta > 0 else None  # scored with the adapters off (polo.lm.lora)
    elif alg.beta > 0:
        # The reference is never trained: under bf16 it is kept in bf16 (half the memory, no casts).
        source = model if resume_from is None else load_policy(config.model.name, attn_implementation=config.model.attn_implementation)[0]
        reference = frozen_copy(source, dtype=torch.bfloat16 if precision != "fp32" else None)
    if train_config.data_parallel == "fsdp" and parallel.is_distributed():
        if alg.advantage_estimator == "gae":
            raise ConfigError("train.data_parallel=fsdp does not support PPO's critic yet; use train.data_parallel=ddp")
        parallel.shard_model(model)  # after the reference copy, which stays whole (it is never trained)

    masters = None
    if precision == "bf16_master":  # after the reference copy, which is cast from the fp32 weights
        masters = MasterWeights(model, torch.bfloat16)
    for module in {id(m): m for m in (model, reference) if m is not None}.values():  # faster attention, same maths (polo.lm.attention)
        use_polo_attention(module)
    optimizer = torch.optim.AdamW(
        masters.parameters if masters is not None else model.parameters(),
        lr=train_config.learning_rate,
        betas=(train_config.adam_beta1, train_config.adam_beta2),
        weight_decay=train_config.weight_decay,
        fused=not parallel.is_sharded(model),  # one kernel per step on CPU: faster, no full-size temporaries (not for DTensor shards)
    )
    if masters is not None:
        masters.attach(optimizer)
    critic = build_critic(config, model, optimizer)  # before the scheduler: a value head joins the optimizer
    modules = update_modules(model, critic)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    start_step, eval_before = 0, None
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", weights_only=False)
        parallel.load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        rng_per_rank = state.get("rng_per_rank", [state["rng"]])
        if len(rng_per_rank) == parallel.world_size():
            restore_rng(rng_per_rank[parallel.rank()])
        else:  # the data position comes from the step, so only the sampling streams change
            if is_main_process():
                print(f"polo: warning: {resume_from} was written by {len(rng_per_rank)} processes, resuming with "
                      f"{parallel.world_size()}: the run goes on, but samples differ from an uninterrupted run")
            seed_everything(train_config.seed + parallel.rank() + 1_000_003 * state["step"])
        load_critic_state(critic, state)
        start_step, eval_before = state["step"], state.get("eval_before")
        if is_main_process():  # the one writer; a second rank rewriting the same file could empty it
            truncate_metrics(output_dir / "metrics.jsonl", start_step)
            truncate_metrics(output_dir / "samples.jsonl", start_step)

    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))

    eval_rows = parallel.eval_share(task.eval_rows)  # each rank greedy-decodes its share of the held-out set
    eval_prompts = task.prompts(tokenizer, eval_rows, instruction, config.task.system_prompt)
    eval_tokens = config.eval.max_new_tokens or config.sampling.max_new_tokens

    def evaluate(step: int) -> dict:
        with sampling_weights(model) as sampler:
            result = greedy_accuracy(
                sampler, tokenizer, eval_prompts, eval_rows, task.correctness,
                max_new_tokens=eval_tokens, batch_size=config.eval.batch_size, precision=precision,
            ) if eval_rows else None
        result = combine_eval(parallel.gather_objects((len(eval_rows), result)))
        logger.log({"step": step, "eval/accuracy": result["accuracy"], "eval/completion_length": result["completion_length"], "eval/truncated": result["truncated"]})
        logger.write(f"step {step}: held-out greedy accuracy {result['accuracy']:.3f} on {len(task.eval_rows)} problems")
        if is_main_process():
            (output_dir / f"eval_step{step:06d}.json").write_text(json.dumps(result, indent=1))
        return result

    logger = MetricsLogger(output_dir, train_config.steps, start_step, config.output.tensorboard, config.output.progress)
    logger.write(
        f"polo: {alg.name} on {task.name} | model {config.model.name} | precision {precision} | "
        f"{train_config.prompts_per_step} prompts x {alg.group_size} completions | steps {start_step}->{train_config.steps}"
        + (f" | LoRA r={lora.r}: {trainable_summary(model)}" if lora.r else "")
    )
    if eval_before is None and config.eval.before and task.eval_rows:
        eval_before = evaluate(0)

    saved_step, nonfinite_streak = start_step, 0
    extra_state = lambda: {"eval_before": eval_before, **critic_state(critic)}  # noqa: E731
    with StopRequest(logger.write) as stop:
        for step in range(start_step + 1, train_config.steps + 1):
            try:
                metrics, samples = rl_step(
                    model, reference, tokenizer, optimizer, scheduler, task, reward_set, step, instruction, config, precision, critic, modules
                )
                nonfinite_streak = 0
            except NonFiniteLossError as error:
                nonfinite_streak += 1
                if nonfinite_streak >= train_config.max_nonfinite_steps:
                    logger.close()
                    raise NonFiniteLossError(
                        f"{nonfinite_streak} steps in a row had a non-finite loss, stopping at step {step} "
                        f"(train.max_nonfinite_steps={train_config.max_nonfinite_steps}); the last good checkpoint is "
                        f"{checkpointer.latest()}. Last error: {error}"
                    ) from error
                logger.write(f"polo: warning: step {step} skipped: {error}")
                metrics, samples = {"skipped_nonfinite": 1.0}, []
            for message in metrics.pop("_messages", []):
                logger.write(message)
            metrics["step"] = step
            logger.log(metrics)
            logger.log_samples(samples)
            logger.advance(step, {"reward": metrics.get("reward/mean", float("nan")), "acc": metrics.get("accuracy", float("nan")), "len": metrics.get("completion_length/mean", float("nan"))})
            if config.eval.every and step % config.eval.every == 0 and step != train_config.steps:
                evaluate(step)
            stopping = parallel.any_rank(stop.requested)  # every rank stops after the same step
            if (config.output.save_every and step % config.output.save_every == 0) or stopping:
                path = checkpointer.save(step, model, tokenizer, optimizer, scheduler, extra_state(), masters)
                saved_step = step
            if stopping:
                logger.write(f"polo: stopped after step {step}; saved {path}; continue with output.resume=true")
                logger.close()
                raise KeyboardInterrupt

    eval_after = evaluate(train_config.steps) if config.eval.after and task.eval_rows else None
    if train_config.steps > saved_step or parallel.any_rank(checkpointer.latest() is None):
        checkpointer.save(train_config.steps, model, tokenizer, optimizer, scheduler, extra_state(), masters)
    logger.close()
    if is_main_process() and config.output.plots:
        from polo.plots import plot_run

        plot_run(output_dir)
    return TrainResult(output_dir, train_config.steps, eval_before, eval_after, read_metrics(output_dir / "metrics.jsonl"))


@contextmanager
def sampling_weights(model) -> Iterator[torch.nn.Module]:
    """Yield the module sampling and evaluation run on: whole weights (gathered under FSDP), LoRA adapters merged in."""
    with parallel.gathered_weights(model), merged_for_sampling(model) as sampler:
        yield sampler


def combine_eval(per_rank: list[tuple[int, dict | None]]) -> dict:
    """Return one greedy-evaluation result from each rank's `(problems, result)` (weighted by problems)."""
    total = sum(count for count, _ in per_rank) or 1
    parts = [(count, result) for count, result in per_rank if result is not None]
    if len(parts) == 1:
        return parts[0][1]
    combined = {key: sum(count * result[key] for count, result in parts) / total for key in ("accuracy", "completion_length", "truncated")}
    return {**combined, "samples": parts[0][1]["samples"]}


@dataclass
class Critic:
    """The value function of PPO and its optimizer: a separate `ValueModel`, or a head on the policy trunk."""

    layout: str  # "separate" | "head"
    module: torch.nn.Module  # ValueModel (separate) or nn.Linear (head)
    optimizer: torch.optim.Optimizer | None  # None for "head": its parameters sit in the policy optimizer
    scheduler: object | None
    warmup_steps: int = 0


def build_critic(config: Config, model, optimizer) -> Critic | None:
    """Return the critic the config asks for (None unless the estimator is GAE)."""
    alg, train_config = config.algorithm, config.train
    if alg.advantage_estimator != "gae":
        return None
    if alg.critic == "head":
        head = new_value_head(model)
        optimizer.add_param_group({"params": list(head.parameters()), "lr": alg.critic_learning_rate, "initial_lr": alg.critic_learning_rate})
        return Critic("head", head, None, None, alg.critic_warmup_steps)
    value_model = ValueModel.from_policy(model)
    value_model.train()
    if train_config.gradient_checkpointing:
        enable_activation_checkpointing(value_model.trunk)
    critic_optimizer = torch.optim.AdamW(
        value_model.parameters(), lr=alg.critic_learning_rate, betas=(train_config.adam_beta1, train_config.adam_beta2),
        weight_decay=train_config.weight_decay, fused=True,
    )
    critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lr_lambda(config))
    return Critic("separate", value_model, critic_optimizer, critic_scheduler, alg.critic_warmup_steps)


def critic_state(critic: Critic | None) -> dict:
    """Return what a checkpoint needs to restore the critic."""
    if critic is None:
        return {}
    state = {"critic": critic.module.state_dict()}
    if critic.optimizer is not None:
        state["critic_optimizer"] = critic.optimizer.state_dict()
        state["critic_scheduler"] = critic.scheduler.state_dict()
    return state


def load_critic_state(critic: Critic | None, state: dict) -> None:
    if critic is None:
        return
    critic.module.load_state_dict(state["critic"])
    if critic.optimizer is not None:
        critic.optimizer.load_state_dict(state["critic_optimizer"])
        critic.scheduler.load_state_dict(state["critic_scheduler"])


@dataclass
class Batch:
    """The completions one step trains on, with their rewards (whole groups, contiguous)."""

    rollouts: Rollouts
    rewards: torch.Tensor  # (batch,) total reward, shaping included
    prompts: list[str]  # one per group


def concat_rollouts(parts: list[Rollouts]) -> Rollouts:
    """Return the rows of several rollouts in one batch (prompts re-left-padded, completions re-right-padded)."""
    if len(parts) == 1:
        return parts[0]
    prompt_len = max(part.prompt_ids.shape[1] for part in parts)
    completion_len = max(part.completion_ids.shape[1] for part in parts)

    def left(tensor, width):
        return torch.nn.functional.pad(tensor, (width - tensor.shape[1], 0))

    def right(tensor, width):
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))

    return Rollouts(
        prompt_ids=torch.cat([left(part.prompt_ids, prompt_len) for part in parts]),
        prompt_mask=torch.cat([left(part.prompt_mask, prompt_len) for part in parts]),
        completion_ids=torch.cat([right(part.completion_ids, completion_len) for part in parts]),
        completion_mask=torch.cat([right(part.completion_mask, completion_len) for part in parts]),
        truncated=torch.cat([part.truncated for part in parts]),
        texts=[text for part in parts for text in part.texts],
        group_size=parts[0].group_size,
    )


def collect_batch(
    model, tokenizer, task: Task, reward_set: RewardSet, step: int, instruction: str, config: Config, precision: str, timings: dict
) -> tuple[Batch | None, dict, list[dict]]:
    """Sample and score this step's groups; return (batch to train on, sampling metrics, sample log rows).

    With `algorithm.dynamic_sampling` (DAPO), groups whose rewards are all equal are dropped and
    more prompts are sampled, up to `max_sampling_rounds` rounds, until `prompts_per_step`
    informative groups are in hand (fewer if the cap is reached). Metrics describe every
    completion sampled, so the reward curve is the policy's, not the filter's. Seconds spent
    sampling and scoring are added to `timings["generation"]` and `timings["reward"]`.

    Under torchrun each rank samples and scores its own share of the step's prompts (whole
    groups); the metrics are computed over the completions of all ranks.
    """
    timings.setdefault("generation", 0.0)
    timings.setdefault("reward", 0.0)
    alg, train_config, sampling = config.algorithm, config.train, config.sampling
    group_size = alg.group_size
    wanted = train_config.prompts_per_step // parallel.world_size()  # this rank's groups
    rounds = alg.max_sampling_rounds if alg.dynamic_sampling else 1
    kept: list[Rollouts] = []
    kept_rewards, kept_prompts, seen, reward_errors = [], [], [], []
    kept_groups = 0
    for round_index in range(rounds):
        # Every rank draws the same step's prompts and keeps its own share: whole prompts, so whole groups.
        all_rows = batch_rows(task.train_rows, step - 1, train_config.prompts_per_step, train_config.seed, stream=round_index)
        row_batch = parallel.rank_share(all_rows, "train.prompts_per_step")
        started = time.perf_counter()
        prompts = task.prompts(tokenizer, row_batch, instruction, config.task.system_prompt)
        with sampling_weights(model) as sampler:
            rollouts = rollout(
                sampler, tokenizer, prompts, group_size,
                max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p, precision=precision,
            )
        timings["generation"] += time.perf_counter() - started
        started = time.perf_counter()
        # Each row also carries the exact prompt text the policy saw, for rewards that read it (a learned reward model).
        rows = [{"prompt_text": prompt, **row} for row, prompt in zip(row_batch, prompts) for _ in range(group_size)]
        rewards, columns = reward_set.score(rollouts.texts, rows)
        reward_errors.extend(reward_set.last_errors)
        if alg.overlong_buffer > 0:
            shaping = core.overlong_penalty(
                rollouts.completion_lengths, sampling.max_new_tokens, alg.overlong_buffer * sampling.max_new_tokens, alg.overlong_penalty
            )
            rewards, columns = rewards + shaping, {**columns, "overlong": shaping}
        correct = reward_set.correctness(rollouts.texts, rows)
        timings["reward"] += time.perf_counter() - started
        seen.append((rollouts, prompts, rewards, columns, correct))
        keep = core.informative_rows(rewards, group_size) if alg.dynamic_sampling else torch.arange(len(rollouts))
        keep = keep[: (wanted - kept_groups) * group_size]
        if len(keep):
            kept.append(rollouts.select(keep))
            kept_rewards.append(rewards[keep])
            kept_prompts.extend(prompts[int(i)] for i in keep[::group_size] // group_size)
            kept_groups += len(keep) // group_size
        if kept_groups >= wanted:
            break
    batch = Batch(concat_rollouts(kept), torch.cat(kept_rewards), kept_prompts) if kept else None

    # Metrics describe the whole step: every rank's completions, gathered (small per-completion vectors).
    local = {
        "rewards": torch.cat([entry[2] for entry in seen]),
        "correct": torch.cat([entry[4] for entry in seen]),
        "lengths": torch.cat([entry[0].completion_lengths for entry in seen]).float(),
        "truncated": torch.cat([entry[0].truncated for entry in seen]),
        **{f"column/{name}": torch.cat([entry[3][name] for entry in seen]) for name in seen[0][3]},
    }
    gathered = parallel.gather_objects(local)
    every = {key: torch.cat([part[key] for part in gathered]) for key in local}
    rewards, correct, lengths, truncated = every["rewards"], every["correct"], every["lengths"], every["truncated"]
    columns = {key.removeprefix("column/"): value for key, value in every.items() if key.startswith("column/")}
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "accuracy": correct.float().mean().item(),
        "completion_length/mean": lengths.mean().item(),
        "completion_length/min": lengths.min().item(),
        "completion_length/max": lengths.max().item(),
        "truncated_fraction": truncated.float().mean().item(),
        "zero_spread_group_fraction": core.zero_spread_groups(rewards, group_size).float().mean().item(),
        **{f"reward/{name}/mean": column.float().mean().item() for name, column in columns.items()},
        **{f"reward/{name}/std": column.float().std().item() if len(column) > 1 else 0.0 for name, column in columns.items()},
    }
    failures = {f"reward/{name}/failures/{kind}": float(count) for name, counts in reward_set.failure_counts().items() for kind, count in counts.items()}
    for part in parallel.gather_objects(failures):  # kinds differ between ranks, so gather rather than all-reduce
        for key, count in part.items():
            metrics[key] = metrics.get(key, 0.0) + count
    if reward_set.on_error == "zero":
        counts = {"reward/errors": float(len(reward_errors))}
        for name in reward_set.names:
            counts[f"reward/{name}/errors"] = float(sum(error.reward_name == name for error in reward_errors))
        metrics.update(parallel.sum_over_ranks(counts))
        # Shown to the user by the training loop (first few only: one broken function can fail every sample).
        metrics["_messages"] = [f"polo: warning: scored 0: {error}" for error in reward_errors[:3]]
    if alg.dynamic_sampling:
        metrics.update({"dynamic_sampling/rounds": len(seen), **parallel.sum_over_ranks({"dynamic_sampling/groups_kept": kept_groups})})
    rollouts, prompts, first_rewards, first_columns, first_correct = seen[0]
    samples = sample_log_rows(step, rollouts, prompts, first_rewards, first_columns, first_correct)
    return batch, metrics, samples


def sample_log_rows(step: int, rollouts: Rollouts, prompts: list[str], rewards, columns: dict, correct) -> list[dict]:
    """Return the best and the worst completion of the step as `samples.jsonl` rows (for reports)."""
    picks = {"best": int(rewards.argmax()), "worst": int(rewards.argmin())}
    return [
        {
            "step": step, "kind": kind, "prompt": prompts[index // rollouts.group_size], "completion": rollouts.texts[index],
            "reward": float(rewards[index]), "rewards": {name: float(column[index]) for name, column in columns.items()},
            "correct": float(correct[index]),
        }
        for kind, index in picks.items()
    ]


@torch.no_grad()
def score_values(critic: Critic, model, rollouts: Rollouts, micro_batch_size: int, precision: str, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (values, log-probs or None) of every completion token before the update, each (batch, completion_len).

    The ``head`` critic shares the policy's forward, so its log-probs come for free; the
    ``separate`` critic runs its own trunk and returns None for the log-probs.
    """
    values = torch.zeros(rollouts.completion_ids.shape, dtype=torch.float32)
    logprobs = torch.zeros(rollouts.completion_ids.shape, dtype=torch.float32) if critic.layout == "head" else None
    for rows in micro_batches(torch.arange(len(rollouts)), micro_batch_size):
        part = trim_padding(rollouts.select(rows))
        width = part.completion_ids.shape[1]
        inputs = (part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask)
        with autocast_context(precision):
            if critic.layout == "head":
                part_logprobs, _, part_values = logprobs_and_values(model, critic.module, *inputs, temperature=temperature)
                logprobs[rows, :width] = part_logprobs.float()
            else:
                part_values = completion_values(critic.module, *inputs)
        values[rows, :width] = part_values.float()
    return values, logprobs


def compute_advantages(batch: Batch, old_logprobs, ref_logprobs, old_values, config: Config) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (per-token advantages (batch, completion_len), value targets or None) for the configured estimator."""
    alg = config.algorithm
    mask = batch.rollouts.completion_mask.float()
    if alg.advantage_estimator == "grpo":
        advantages = core.group_advantages(batch.rewards, alg.group_size, scale_by_std=alg.scale_rewards, eps=alg.advantage_eps)
        return core.expand_to_tokens(advantages, mask), None
    if alg.advantage_estimator == "rloo":
        return core.expand_to_tokens(core.rloo_advantages(batch.rewards, alg.group_size), mask), None
    kl = core.kl_estimate(old_logprobs, ref_logprobs, alg.kl_estimator) if alg.kl_in_reward else None
    token_rewards = core.token_level_rewards(batch.rewards, mask, kl, alg.beta)
    if alg.advantage_estimator == "reinforce_pp":
        return core.reinforce_pp_advantages(token_rewards, mask, alg.gamma), None
    advantages, returns = core.gae_advantages(token_rewards, old_values, mask, alg.gamma, alg.lam)
    return core.whiten(advantages, mask), returns


def align_groups(batch: Batch | None, group_size: int) -> Batch | None:
    """Return the batch cut to the fewest groups any rank holds (None when some rank has none).

    Dynamic sampling can leave ranks with different numbers of informative groups; DDP needs
    every rank to take the same optimizer steps, so each keeps only as many groups as the
    poorest rank. In one process the batch comes back unchanged.
    """
    groups = parallel.min_over_ranks(len(batch.rollouts) // group_size if batch is not None else 0)
    if groups == 0:
        return None
    if groups * group_size == len(batch.rollouts):
        return batch
    rows = torch.arange(groups * group_size)
    return Batch(batch.rollouts.select(rows), batch.rewards[rows], batch.prompts[:groups])


def rl_step(
    model, reference, tokenizer, optimizer, scheduler, task: Task, reward_set: RewardSet, step: int, instruction: str,
    config: Config, precision: str, critic: Critic | None = None, modules: parallel.UpdateModules | None = None,
) -> tuple[dict, list[dict]]:
    """Run one sampling + update step in place; return (metrics row, sample log rows).

    `modules` are the (DDP-wrapped under torchrun) modules the update runs through; None builds
    plain ones. Under torchrun the returned metrics are combined over all ranks.
    """
    alg, train_config, sampling = config.algorithm, config.train, config.sampling
    timings = {}

    batch, metrics, samples = collect_batch(model, tokenizer, task, reward_set, step, instruction, config, precision, timings)
    batch = align_groups(batch, alg.group_size) if alg.dynamic_sampling else batch
    if batch is None:  # dynamic sampling found no informative group within its cap
        metrics.update({"update_skipped": 1.0, "learning_rate": scheduler.get_last_lr()[0], **{f"time/{k}": v for k, v in timings.items()}})
        metrics["time/step"] = sum(timings.values())
        return parallel.combine_metrics(parallel.gather_objects(metrics)), samples
    rollouts = batch.rollouts

    started = time.perf_counter()
    ref_logprobs = None
    if alg.beta > 0:
        with reference_scope(model, reference):  # the LoRA policy itself, adapters off
            ref_logprobs = score_completions(reference, rollouts, train_config.micro_batch_size, precision, sampling.temperature)
    old_logprobs = old_values = None
    if critic is not None:
        old_values, old_logprobs = score_values(critic, model, rollouts, train_config.micro_batch_size, precision, sampling.temperature)
    if old_logprobs is None and (alg.update_epochs > 1 or alg.kl_in_reward):
        with parallel.gathered_weights(model):
            old_logprobs = score_completions(model, rollouts, train_config.micro_batch_size, precision, sampling.temperature)
    advantages, returns = compute_advantages(batch, old_logprobs, ref_logprobs, old_values, config)
    timings["reference"] = time.perf_counter() - started

    started = time.perf_counter()
    value_targets = (old_values, returns) if critic is not None else None
    update_metrics = policy_update(
        model, optimizer, scheduler, rollouts, advantages, old_logprobs, ref_logprobs, config, precision,
        critic=critic, value_targets=value_targets, train_policy=critic is None or step > critic.warmup_steps, modules=modules,
    )
    timings["update"] = time.perf_counter() - started

    total_time = sum(timings.values())
    metrics.update({
        "advantage/abs_mean": core.masked_mean(advantages.abs(), rollouts.completion_mask).item(),
        "learning_rate": scheduler.get_last_lr()[0],
        **update_metrics,
        **{f"time/{name}": seconds for name, seconds in timings.items()},
        "time/step": total_time,
        "tokens_per_second": float(rollouts.completion_mask.sum() + rollouts.prompt_mask.sum()) / max(total_time, 1e-9),
    })
    if returns is not None:
        metrics["value/explained_variance"] = core.explained_variance(old_values, returns, rollouts.completion_mask)
        metrics["value/mean"] = core.masked_mean(old_values, rollouts.completion_mask).item()
    return parallel.combine_metrics(parallel.gather_objects(metrics)), samples


def update_modules(model, critic: Critic | None) -> parallel.UpdateModules:
    """Return the modules policy updates run through (DDP-wrapped inside a process group; build once per run)."""
    head = critic.module if critic is not None and critic.layout == "head" else None
    value_model = critic.module if critic is not None and critic.layout == "separate" else None
    # A value head warming up alone leaves the policy's weights without gradients, which DDP must be told.
    find_unused = head is not None and critic.warmup_steps > 0
    return parallel.build_update_modules(model, head, value_model, find_unused_parameters=find_unused)


def micro_value_loss(values: torch.Tensor, value_targets, micro: torch.Tensor, mask: torch.Tensor, alg, normalisers: dict) -> torch.Tensor:
    """Return the clipped value loss of one micro-batch, token-mean over the whole minibatch."""
    old_values, returns = value_targets
    width = values.shape[1]
    per_token = core.value_loss(values.float(), old_values[micro, :width], returns[micro, :width], mask, alg.value_clip)
    return core.aggregate_loss(per_token, mask, "dapo", **normalisers)


def backward_checked(loss: torch.Tensor, optimizer, scheduler, loss_scale: float = 1.0) -> None:
    """Backpropagate `loss_scale * loss`, or raise `NonFiniteLossError` (after dropping the gradients) when
    the loss is NaN or infinite on any rank (the decision is collective, so no rank waits alone in a backward)."""
    if parallel.any_rank(not bool(torch.isfinite(loss))):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(
            f"loss is {loss.item()} on rank {parallel.rank()} (optimizer step {scheduler.last_epoch + 1}); a rank had a "
            "non-finite loss, the update was not applied and the last checkpoint is intact. "
            "Try a lower train.learning_rate or check the reward functions."
        )
    if loss.requires_grad:
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()


def policy_update(
    model, optimizer, scheduler, rollouts: Rollouts, advantages: torch.Tensor, old_logprobs, ref_logprobs, config: Config, precision: str,
    *, critic: Critic | None = None, value_targets: tuple[torch.Tensor, torch.Tensor] | None = None, train_policy: bool = True,
    modules: parallel.UpdateModules | None = None,
) -> dict:
    """Apply `update_epochs` x `num_minibatches` optimizer steps and return averaged update metrics.

    `advantages` is (batch,) per sequence or (batch, completion_len) per token. With a critic,
    `value_targets` = (old values, returns), each (batch, completion_len), and the value loss is
    trained alongside; `train_policy=False` (critic warm-up) leaves the policy untouched.
    Normalisers (sequences, valid tokens) are global per optimizer step: counted over the whole
    minibatch and all ranks through `polo.core.global_count`, so gradient accumulation over
    micro-batches gives exactly the full-minibatch gradient. Forward and backward go through
    `modules` (DDP-wrapped under torchrun; built plain when None): gradients stay local until
    the last micro-batch of a minibatch, whose backward all-reduces them.
    """
    alg, train_config = config.algorithm, config.train
    if modules is None:
        modules = update_modules(model, critic)
    group_size = rollouts.group_size
    num_groups = len(rollouts) // group_size
    groups_per_minibatch = max(math.ceil(num_groups / train_config.num_minibatches), 1)
    loss_mask = rollouts.completion_mask.float()
    if alg.mask_truncated:  # DAPO's overlong filtering: truncated completions teach nothing
        loss_mask = loss_mask * (~rollouts.truncated).float().unsqueeze(-1)
    kl_in_loss = ref_logprobs is not None and not alg.kl_in_reward
    sums = {key: 0.0 for key in ("kl", "entropy", "clip_low", "clip_high", "tokens", "loss", "grad_norm", "value_loss", "critic_grad_norm")}
    optimizer_steps = 0
    for _ in range(alg.update_epochs):
        for first_group in range(0, num_groups, groups_per_minibatch):
            rows = torch.arange(first_group * group_size, min(first_group + groups_per_minibatch, num_groups) * group_size)
            num_sequences = core.global_count(len(rows))
            num_tokens = core.global_count(loss_mask[rows].sum().clamp(min=1.0))
            normalisers = {"num_sequences": num_sequences, "num_tokens": num_tokens, "max_completion_length": config.sampling.max_new_tokens}
            optimizer.zero_grad(set_to_none=True)
            if critic is not None and critic.optimizer is not None:
                critic.optimizer.zero_grad(set_to_none=True)
            minibatch_loss = 0.0
            micros = micro_batches(rows, train_config.micro_batch_size, group_size)
            for index, micro in enumerate(micros):
                with modules.gradient_sync(index == len(micros) - 1):
                    part = trim_padding(rollouts.select(micro))
                    width = part.completion_ids.shape[1]
                    mask = loss_mask[micro, :width]
                    inputs = (part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask)
                    loss = torch.zeros(())
                    values = None
                    if train_policy or (critic is not None and critic.layout == "head"):
                        with autocast_context(precision):
                            logprobs, entropy, values = modules.policy(
                                *inputs, temperature=config.sampling.temperature, detach_trunk_for_values=not train_policy,
                                group_size=group_size,
                            )
                    if train_policy:
                        logprobs = logprobs.float()
                        old = old_logprobs[micro, :width] if old_logprobs is not None else logprobs.detach()
                        token_advantages = advantages[micro, :width] if advantages.dim() == 2 else advantages[micro]
                        loss_fn = core.gspo_loss if alg.policy_loss == "gspo" else core.ppo_clip_loss
                        per_token, stats = loss_fn(logprobs, old, token_advantages, mask, alg.clip_eps_low, alg.clip_eps_high)
                        if kl_in_loss:
                            kl = core.kl_estimate(logprobs, ref_logprobs[micro, :width], alg.kl_estimator)
                            per_token = per_token + alg.beta * kl
                            sums["kl"] += float((kl.detach() * mask).sum())
                        loss = core.aggregate_loss(per_token, mask, alg.loss_aggregation, **normalisers)
                        sums["entropy"] += float((entropy * mask).sum())
                        sums["clip_low"] += float(stats["clip_low_count"])
                        sums["clip_high"] += float(stats["clip_high_count"])
                    if values is not None:  # value head on the shared trunk: one backward for both losses
                        value_loss = micro_value_loss(values, value_targets, micro, mask, alg, normalisers)
                        sums["value_loss"] += float(value_loss.detach())
                        loss = loss + alg.value_coef * value_loss
                    backward_checked(loss, optimizer, scheduler, modules.loss_scale)
                    minibatch_loss += loss.item()
                    if critic is not None and critic.layout == "separate":
                        # The critic's graph is built only after the policy's is freed: half the peak activations.
                        with autocast_context(precision):
                            values = completion_values(modules.critic, *inputs)
                        value_loss = alg.value_coef * micro_value_loss(values, value_targets, micro, mask, alg, normalisers)
                        backward_checked(value_loss, critic.optimizer, scheduler, modules.loss_scale)
                        sums["value_loss"] += float(value_loss.detach()) / alg.value_coef
                        minibatch_loss += value_loss.item()
                    sums["tokens"] += float(mask.sum())
            grad_norm = parallel.global_norm(
                torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], train_config.max_grad_norm)
            )
            if not torch.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteLossError(f"gradient norm is {grad_norm.item()}; the update was not applied and the last checkpoint is intact")
            if critic is not None and critic.optimizer is not None:
                sums["critic_grad_norm"] += float(torch.nn.utils.clip_grad_norm_(critic.module.parameters(), train_config.max_grad_norm))
                critic.optimizer.step()
                critic.scheduler.step()
            optimizer.step()  # parameters without a gradient (the policy during critic warm-up) are left alone
            scheduler.step()
            optimizer_steps += 1
            sums["loss"] += minibatch_loss
            sums["grad_norm"] += float(grad_norm)
    # Per-rank sums -> global sums (gradient norms are already global: measured after the all-reduce).
    sums.update(parallel.sum_over_ranks({key: value for key, value in sums.items() if "grad_norm" not in key}))
    tokens = max(sums["tokens"], 1.0)
    metrics = {"loss": sums["loss"] / optimizer_steps, "grad_norm": sums["grad_norm"] / optimizer_steps}
    if train_policy:
        metrics.update({
            "entropy": sums["entropy"] / tokens,
            "clip_fraction/low": sums["clip_low"] / tokens,
            "clip_fraction/high": sums["clip_high"] / tokens,
        })
    if kl_in_loss and train_policy:
        metrics["kl"] = sums["kl"] / tokens
    elif ref_logprobs is not None and old_logprobs is not None:
        metrics["kl"] = core.masked_mean(old_logprobs - ref_logprobs, rollouts.completion_mask).item()  # k1 of the sampled batch
    if critic is not None:
        metrics["value/loss"] = sums["value_loss"] / optimizer_steps
        if critic.optimizer is not None:
            metrics["value/grad_norm"] = sums["critic_grad_norm"] / optimizer_steps
    return metrics
