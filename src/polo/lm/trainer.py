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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from polo import core
from polo.config import Config, config_to_dict, load_config
from polo.lm.evaluate import greedy_accuracy
from polo.lm.models import frozen_copy, load_policy
from polo.lm.rewards import RewardSet
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
}


def make_task(config: Config) -> Task:
    """Return the task the config names, built with the options that task understands."""
    task_config = config.task
    keys = TASK_OPTIONS.get(task_config.name, ())
    options = {key: getattr(task_config, key) for key in keys if getattr(task_config, key) is not None}
    return build_task(task_config.name, **options)


def instruction_for(config: Config) -> str:
    """Return the prompt instruction template: the configured one, else the task form's default."""
    if config.task.instruction is not None:
        return config.task.instruction
    return DEFAULT_INSTRUCTION if config.task.answer_in_tags else PLAIN_INSTRUCTION


def resolve_precision(precision: str) -> str:
    """Return "bf16" or "fp32" for a configured precision ("auto" picks bf16 where the CPU has it)."""
    if precision == "auto":
        return "bf16" if cpu_supports_bf16() else "fp32"
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


def batch_rows(rows: list[dict], step: int, prompts_per_step: int, seed: int) -> list[dict]:
    """Return the prompts for `step`: consecutive slices of a per-epoch shuffle, a pure function of step.

    Because the data position is derived from the step number, resuming needs no sampler state.
    """
    picked = []
    start = step * prompts_per_step
    for position in range(start, start + prompts_per_step):
        epoch, index = divmod(position, len(rows))
        order = np.random.default_rng([seed, epoch]).permutation(len(rows))
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


def micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Return `rows` (1-D indices) cut into consecutive chunks of at most `size`."""
    return [rows[start : start + size] for start in range(0, len(rows), size)]


@torch.no_grad()
def score_completions(model, rollouts: Rollouts, micro_batch_size: int, precision: str, temperature: float) -> torch.Tensor:
    """Return per-token log-probs of every completion under `model` (no gradient), (batch, completion_len)."""
    scored = torch.zeros(rollouts.completion_ids.shape, dtype=torch.float32)
    for rows in micro_batches(torch.arange(len(rollouts)), micro_batch_size):
        part = trim_padding(rollouts.select(rows))
        with autocast_context(precision):
            logprobs, _ = completion_logprobs(
                model, part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask, temperature=temperature
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

    def save(self, step: int, model, tokenizer, optimizer, scheduler, extra: dict) -> Path | None:
        if not is_main_process():
            return None
        target = self.root / f"step-{step:06d}"
        staging = self.root / f".incomplete-step-{step:06d}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            **extra,
        }
        torch.save(state, staging / "trainer_state.pt")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # a checkpoint exists only once it is whole
        checkpoints = sorted(self.root.glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
        for old in checkpoints[: max(len(checkpoints) - self.keep, 0)]:
            shutil.rmtree(old)
        return target


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
    added to the configured rewards.
    """
    if not isinstance(config, Config):
        config = load_config(config, overrides)
    elif overrides:
        config = load_config(config_to_dict(config), overrides)
    alg, train_config = config.algorithm, config.train
    output_dir = Path(config.output.dir)
    precision = resolve_precision(train_config.precision)
    if train_config.threads:
        torch.set_num_threads(train_config.threads)

    task = make_task(config)
    weights: dict = dict(config.rewards)
    weights.update(reward_functions or {})
    reward_set = RewardSet(weights, task)
    instruction = instruction_for(config)

    checkpointer = Checkpointer(output_dir, config.output.keep_checkpoints)
    resume_from = checkpointer.latest() if config.output.resume else None
    if config.output.resume and resume_from is None:
        print(f"polo: resume=true but no checkpoint in {checkpointer.root}; starting from step 0")
    if resume_from is None and (output_dir / "metrics.jsonl").exists() and is_main_process():
        (output_dir / "metrics.jsonl").unlink()  # a fresh run must not mix with an old run's rows

    seed_everything(train_config.seed)
    model, tokenizer = load_policy(str(resume_from) if resume_from else config.model.name, attn_implementation=config.model.attn_implementation)
    model.train()
    if train_config.gradient_checkpointing:
        checkpointing_kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
    reference = None
    if alg.beta > 0:
        # The reference is never trained: under bf16 it is kept in bf16 (half the memory, no casts).
        source = model if resume_from is None else load_policy(config.model.name, attn_implementation=config.model.attn_implementation)[0]
        reference = frozen_copy(source, dtype=torch.bfloat16 if precision == "bf16" else None)

    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=train_config.learning_rate,
        betas=(train_config.adam_beta1, train_config.adam_beta2),
        weight_decay=train_config.weight_decay,
        fused=True,  # one kernel per step on CPU: faster, and no full-size temporaries
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    start_step, eval_before = 0, None
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        start_step, eval_before = state["step"], state.get("eval_before")
        truncate_metrics(output_dir / "metrics.jsonl", start_step)

    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))

    eval_prompts = task.prompts(tokenizer, task.eval_rows, instruction, config.task.system_prompt)
    eval_tokens = config.eval.max_new_tokens or config.sampling.max_new_tokens

    def evaluate(step: int) -> dict:
        result = greedy_accuracy(
            model, tokenizer, eval_prompts, task.eval_rows, task.correctness,
            max_new_tokens=eval_tokens, batch_size=config.eval.batch_size, precision=precision,
        )
        logger.log({"step": step, "eval/accuracy": result["accuracy"], "eval/completion_length": result["completion_length"], "eval/truncated": result["truncated"]})
        logger.write(f"step {step}: held-out greedy accuracy {result['accuracy']:.3f} on {len(task.eval_rows)} problems")
        if is_main_process():
            (output_dir / f"eval_step{step:06d}.json").write_text(json.dumps(result, indent=1))
        return result

    logger = MetricsLogger(output_dir, train_config.steps, start_step, config.output.tensorboard, config.output.progress)
    logger.write(
        f"polo: {alg.name} on {task.name} | model {config.model.name} | precision {precision} | "
        f"{train_config.prompts_per_step} prompts x {alg.group_size} completions | steps {start_step}->{train_config.steps}"
    )
    if eval_before is None and config.eval.before and task.eval_rows:
        eval_before = evaluate(0)

    saved_step = start_step
    extra_state = lambda: {"eval_before": eval_before}  # noqa: E731
    with StopRequest(logger.write) as stop:
        for step in range(start_step + 1, train_config.steps + 1):
            row_batch = batch_rows(task.train_rows, step - 1, train_config.prompts_per_step, train_config.seed)
            metrics = grpo_step(model, reference, tokenizer, optimizer, scheduler, task, reward_set, row_batch, instruction, config, precision)
            metrics["step"] = step
            logger.log(metrics)
            logger.advance(step, {"reward": metrics["reward/mean"], "acc": metrics["accuracy"], "len": metrics["completion_length/mean"]})
            if config.eval.every and step % config.eval.every == 0 and step != train_config.steps:
                evaluate(step)
            if (config.output.save_every and step % config.output.save_every == 0) or stop.requested:
                path = checkpointer.save(step, model, tokenizer, optimizer, scheduler, extra_state())
                saved_step = step
            if stop.requested:
                logger.write(f"polo: stopped after step {step}; saved {path}; continue with output.resume=true")
                logger.close()
                raise KeyboardInterrupt

    eval_after = evaluate(train_config.steps) if config.eval.after and task.eval_rows else None
    if train_config.steps > saved_step or not checkpointer.latest():
        checkpointer.save(train_config.steps, model, tokenizer, optimizer, scheduler, extra_state())
    logger.close()
    if is_main_process() and config.output.plots:
        from polo.plots import plot_run

        plot_run(output_dir)
    return TrainResult(output_dir, train_config.steps, eval_before, eval_after, read_metrics(output_dir / "metrics.jsonl"))


def grpo_step(model, reference, tokenizer, optimizer, scheduler, task: Task, reward_set: RewardSet, row_batch: list[dict], instruction: str, config: Config, precision: str) -> dict:
    """Run one sampling + update step in place and return its metrics row."""
    alg, train_config, sampling = config.algorithm, config.train, config.sampling
    group_size = alg.group_size
    timings = {}

    started = time.perf_counter()
    prompts = task.prompts(tokenizer, row_batch, instruction, config.task.system_prompt)
    rollouts = rollout(
        model, tokenizer, prompts, group_size,
        max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p, precision=precision,
    )
    timings["generation"] = time.perf_counter() - started

    started = time.perf_counter()
    rows = [row for row in row_batch for _ in range(group_size)]
    rewards, reward_columns = reward_set.score(rollouts.texts, rows)
    correct = reward_set.correctness(rollouts.texts, rows)
    advantages = core.group_advantages(rewards, group_size, scale_by_std=alg.scale_rewards, eps=alg.advantage_eps)
    timings["reward"] = time.perf_counter() - started

    started = time.perf_counter()
    ref_logprobs = score_completions(reference, rollouts, train_config.micro_batch_size, precision, sampling.temperature) if alg.beta > 0 else None
    old_logprobs = score_completions(model, rollouts, train_config.micro_batch_size, precision, sampling.temperature) if alg.update_epochs > 1 else None
    timings["reference"] = time.perf_counter() - started

    started = time.perf_counter()
    update_metrics = policy_update(model, optimizer, scheduler, rollouts, advantages, old_logprobs, ref_logprobs, config, precision)
    timings["update"] = time.perf_counter() - started

    lengths = rollouts.completion_lengths.float()
    total_time = sum(timings.values())
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "accuracy": correct.float().mean().item(),
        "completion_length/mean": lengths.mean().item(),
        "completion_length/min": lengths.min().item(),
        "completion_length/max": lengths.max().item(),
        "truncated_fraction": rollouts.truncated.float().mean().item(),
        "zero_spread_group_fraction": core.zero_spread_groups(rewards, group_size).float().mean().item(),
        "advantage/abs_mean": advantages.abs().mean().item(),
        "learning_rate": scheduler.get_last_lr()[0],
        **{f"reward/{name}/mean": column.float().mean().item() for name, column in reward_columns.items()},
        **{f"reward/{name}/std": column.float().std().item() if len(column) > 1 else 0.0 for name, column in reward_columns.items()},
        **update_metrics,
        **{f"time/{name}": seconds for name, seconds in timings.items()},
        "time/step": total_time,
        "tokens_per_second": float(rollouts.completion_mask.sum() + rollouts.prompt_mask.sum()) / max(total_time, 1e-9),
    }
    return metrics


def policy_update(model, optimizer, scheduler, rollouts: Rollouts, advantages: torch.Tensor, old_logprobs, ref_logprobs, config: Config, precision: str) -> dict:
    """Apply `update_epochs` x `num_minibatches` optimizer steps and return averaged update metrics.

    Normalisers (sequences, valid tokens) are global per optimizer step: counted over the whole
    minibatch and all ranks through `polo.core.global_count`, so gradient accumulation over
    micro-batches gives exactly the full-minibatch gradient.
    """
    alg, train_config = config.algorithm, config.train
    group_size = rollouts.group_size
    num_groups = len(rollouts) // group_size
    groups_per_minibatch = num_groups // train_config.num_minibatches
    sums = {"kl": 0.0, "entropy": 0.0, "clip_low": 0.0, "clip_high": 0.0, "tokens": 0.0, "loss": 0.0, "grad_norm": 0.0}
    optimizer_steps = 0
    for _ in range(alg.update_epochs):
        for minibatch in range(train_config.num_minibatches):
            first = minibatch * groups_per_minibatch * group_size
            rows = torch.arange(first, first + groups_per_minibatch * group_size)
            num_sequences = core.global_count(len(rows))
            num_tokens = core.global_count(rollouts.completion_mask[rows].sum())
            optimizer.zero_grad(set_to_none=True)
            minibatch_loss = 0.0
            for micro in micro_batches(rows, train_config.micro_batch_size):
                part = trim_padding(rollouts.select(micro))
                width = part.completion_ids.shape[1]
                mask = part.completion_mask.float()
                with autocast_context(precision):
                    logprobs, entropy = completion_logprobs(
                        model, part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask,
                        temperature=config.sampling.temperature, with_entropy=True,
                    )
                logprobs = logprobs.float()
                old = old_logprobs[micro, :width] if old_logprobs is not None else logprobs.detach()
                per_token, stats = core.ppo_clip_loss(logprobs, old, advantages[micro], mask, alg.clip_eps_low, alg.clip_eps_high)
                if ref_logprobs is not None:
                    kl = core.kl_estimate(logprobs, ref_logprobs[micro, :width], alg.kl_estimator)
                    per_token = per_token + alg.beta * kl
                    sums["kl"] += float((kl.detach() * mask).sum())
                loss = core.aggregate_loss(
                    per_token, mask, alg.loss_aggregation,
                    num_sequences=num_sequences, num_tokens=num_tokens, max_completion_length=config.sampling.max_new_tokens,
                )
                if not torch.isfinite(loss):
                    optimizer.zero_grad(set_to_none=True)
                    raise NonFiniteLossError(
                        f"loss is {loss.item()} (optimizer step {scheduler.last_epoch + 1}); the update was not applied and "
                        "the last checkpoint is intact. Try a lower train.learning_rate or check the reward functions."
                    )
                loss.backward()
                minibatch_loss += loss.item()
                sums["entropy"] += float((entropy * mask).sum())
                sums["clip_low"] += float(stats["clip_low_count"])
                sums["clip_high"] += float(stats["clip_high_count"])
                sums["tokens"] += float(mask.sum())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.max_grad_norm)
            if not torch.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteLossError(f"gradient norm is {grad_norm.item()}; the update was not applied and the last checkpoint is intact")
            optimizer.step()
            scheduler.step()
            optimizer_steps += 1
            sums["loss"] += minibatch_loss
            sums["grad_norm"] += float(grad_norm)
    tokens = max(sums["tokens"], 1.0)
    metrics = {
        "loss": sums["loss"] / optimizer_steps,
        "grad_norm": sums["grad_norm"] / optimizer_steps,
        "entropy": sums["entropy"] / tokens,
        "clip_fraction/low": sums["clip_low"] / tokens,
        "clip_fraction/high": sums["clip_high"] / tokens,
    }
    if ref_logprobs is not None:
        metrics["kl"] = sums["kl"] / tokens
    return metrics
