"""One RL step, top to bottom: sample -> score -> (reference / old log-probs) -> advantages -> update.

`rl_step(run, step)` is the whole of it; each stage is a function below. Under torchrun every
rank samples and scores its own share of the step's prompts (whole groups), and the metrics are
combined over all ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from polo import core
from polo.config import Config
from polo.generation.episodes import episode_metrics
from polo.generation.rollouts import Decoding, Rollouts
from polo.kernels import common_prefix_length
from polo.models.lora import merged_for_sampling, reference_scope
from polo.models.scoring import completion_logprobs
from polo.rewards.forms import RewardProgress
from polo.rl.batching import (
    Batch,
    UpdateBatch,
    align_groups,
    batch_rows,
    concat_batches,
    micro_batches,
    on_device,
    trim_padding,
)
from polo.rl.setup import Run
from polo.rl.update import optimizer_steps_per_batch, policy_update
from polo.runtime import parallel
from polo.runtime.device import Compute, memory_metrics
from polo.runtime.trackers import logs_tables


@dataclass
class ScoredRound:
    """One sampling round of this rank: the sampled groups with their rewards, correctness and reward errors."""

    batch: Batch  # rollouts, total rewards (shaping included), one prompt per group, per-function reward columns
    correct: torch.Tensor  # (batch,) 1.0 where the task's checker accepts the completion
    errors: list = field(default_factory=list)  # the reward functions' errors scored 0 (train.on_reward_error: zero)
    unscorable: int = 0  # completions no reward applied to (every TRL-form reward returned None)


@dataclass
class SampledStep:
    """What sampling and scoring hand to the update: the batch to train on, and what to log about every sample."""

    batch: Batch | None  # None when dynamic sampling found no informative group within its cap
    metrics: dict[str, float]  # reward, accuracy, length and failure metrics over every completion of every rank
    samples: list[dict]  # the best and the worst completion, as samples.jsonl rows
    messages: list[str] = field(default_factory=list)  # warnings for the user (this rank's)


@dataclass
class PreUpdateScores:
    """Each (batch, completion_len), scored before the update; None where the step does not need it."""

    reference_logprobs: torch.Tensor | None = None  # under the reference (beta > 0)
    old_logprobs: torch.Tensor | None = (
        None  # under the sampling policy (several optimizer steps, a critic, kl_in_reward)
    )
    old_values: torch.Tensor | None = None  # the critic's values


@dataclass
class StepResult:
    """What one RL step hands the training loop, combined over ranks."""

    metrics: dict[str, float]  # the step's metrics row
    samples: list[dict] = field(default_factory=list)  # samples.jsonl rows
    # A completions-table row per completion trained on, from every rank (only when a tracker keeps tables).
    completions: list[dict] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # lines to show the user


@contextmanager
def sampling_weights(model) -> Iterator[torch.nn.Module]:
    """Yield the module sampling and evaluation run on: whole weights (gathered under FSDP), LoRA adapters merged in."""
    with parallel.gathered_weights(model), merged_for_sampling(model) as sampler:
        yield sampler


@torch.no_grad()
def score_completions(
    model, rollouts: Rollouts, micro_batch_size: int, compute: Compute, temperature: float
) -> torch.Tensor:
    """Return per-token log-probs of every completion under `model` (no gradient).

    Shape (batch, completion_len), on the rollouts' device.
    """
    device = rollouts.completion_ids.device
    scored = torch.zeros(rollouts.completion_ids.shape, dtype=torch.float32, device=device)
    for rows in micro_batches(torch.arange(len(rollouts), device=device), micro_batch_size, rollouts.group_size):
        part = trim_padding(rollouts.select(rows))
        with compute.autocast():
            logprobs, _ = completion_logprobs(
                model,
                part.prompt_ids,
                part.prompt_mask,
                part.completion_ids,
                part.completion_mask,
                temperature=temperature,
                group_size=rollouts.group_size,
            )
        scored[rows, : logprobs.shape[1]] = logprobs.float()
    return scored


def sample_and_score(run: Run, step: int, round_index: int, timings: dict) -> ScoredRound:
    """Return this rank's share of the step's prompts (draw `round_index`), sampled and scored.

    Adds the seconds spent sampling and scoring to `timings`.
    """
    config, alg, sampling = run.config, run.config.algorithm, run.config.sampling
    # Every rank draws the same step's prompts and keeps its own share: whole prompts, so whole groups.
    all_rows = batch_rows(
        run.task.train_rows,
        step - 1 + run.data_offset,
        config.train.prompts_per_step,
        config.train.seed,
        stream=round_index,
    )
    row_batch = parallel.rank_share(all_rows, "train.prompts_per_step")
    started = time.perf_counter()
    prompts = run.task.prompts(run.tokenizer, row_batch, run.instruction, config.task.system_prompt)
    with sampling_weights(run.model) as sampler:
        rollouts = run.sampler(
            sampler,
            run.tokenizer,
            prompts,
            alg.group_size,
            Decoding(
                sampling.max_new_tokens,
                sampling.temperature,
                sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty,
                record_logprobs=alg.sampler_correction is not None,  # the sampler's own, for the correction
            ),
            compute=run.compute,
            rows=row_batch,
        )
    rollouts = on_device(rollouts, run.compute.device)  # the one place a step's data is put on the run's device
    timings["generation"] += time.perf_counter() - started
    started = time.perf_counter()
    # Each row also carries the exact prompt text the policy saw, for rewards that read it (a learned reward model).
    rows = [{"prompt_text": prompt, **row} for row, prompt in zip(row_batch, prompts) for _ in range(alg.group_size)]
    rewards, columns = run.reward_set.score(
        rollouts.texts,
        rows,
        run.compute.device,
        completion_ids=completion_token_ids(rollouts),
        progress=RewardProgress(global_step=step - 1, max_steps=config.train.steps),
    )
    errors = list(run.reward_set.last_errors)
    if alg.overlong_buffer > 0:
        shaping = core.overlong_penalty(
            rollouts.completion_lengths,
            sampling.max_new_tokens,
            alg.overlong_buffer * sampling.max_new_tokens,
            alg.overlong_penalty,
        )
        rewards, columns = rewards + shaping, {**columns, "overlong": shaping}
    if rollouts.episodes is not None and any(episode.reward is not None for episode in rollouts.episodes):
        # An environment that owns a reward adds it as one more column.
        own = [episode.reward or 0.0 for episode in rollouts.episodes]
        own = torch.tensor(own, dtype=rewards.dtype, device=rewards.device)
        rewards, columns = rewards + own, {**columns, "environment": own}
    correct = run.reward_set.correctness(rollouts.texts, rows, run.compute.device)
    timings["reward"] += time.perf_counter() - started
    return ScoredRound(Batch(rollouts, rewards, prompts, columns), correct, errors, run.reward_set.last_unscorable)


def completion_token_ids(rollouts: Rollouts) -> list[list[int]]:
    """Return each completion's sampled token ids, its EOS included and its padding left out."""
    lengths = rollouts.completion_lengths.tolist()
    return [ids[:length] for ids, length in zip(rollouts.completion_ids.tolist(), lengths)]


def collect_batch(run: Run, step: int, timings: dict) -> SampledStep:
    """Return this step's groups sampled and scored: the batch to train on, its metrics and sample log rows.

    With `algorithm.dynamic_sampling` (DAPO), groups whose rewards are all equal are dropped and
    more prompts are sampled, up to `max_sampling_rounds` rounds, until `prompts_per_step`
    informative groups are in hand (fewer if the cap is reached). Metrics describe every
    completion sampled, so the reward curve is the policy's, not the filter's.
    """
    timings.setdefault("generation", 0.0)
    timings.setdefault("reward", 0.0)
    alg, group_size = run.config.algorithm, run.config.algorithm.group_size
    wanted = run.config.train.prompts_per_step // parallel.world_size()  # this rank's groups
    kept: list[Batch] = []
    seen: list[ScoredRound] = []
    kept_groups = 0
    for round_index in range(alg.max_sampling_rounds if alg.dynamic_sampling else 1):
        scored = sample_and_score(run, step, round_index, timings)
        seen.append(scored)
        rewards = scored.batch.rewards
        keep = (
            core.informative_rows(rewards, group_size)
            if alg.dynamic_sampling
            else torch.arange(len(rewards), device=rewards.device)
        )
        keep = keep[: (wanted - kept_groups) * group_size]
        if len(keep):
            kept.append(scored.batch.select(keep))
            kept_groups += len(keep) // group_size
        if kept_groups >= wanted:
            break
    return SampledStep(
        batch=concat_batches(kept) if kept else None,
        metrics=sampling_metrics(run, seen, kept_groups),
        samples=sample_log_rows(step, seen[0]),
        messages=reward_error_messages(run, seen),
    )


def sampling_metrics(run: Run, seen: list[ScoredRound], kept_groups: int) -> dict:
    """Return the step's reward, accuracy, length and failure metrics over every completion of every rank."""
    alg, reward_set = run.config.algorithm, run.reward_set
    batches = [entry.batch for entry in seen]
    local = {
        "rewards": torch.cat([batch.rewards for batch in batches]),
        "correct": torch.cat([entry.correct for entry in seen]),
        "lengths": torch.cat([batch.rollouts.completion_lengths for batch in batches]).float(),
        "truncated": torch.cat([batch.rollouts.truncated for batch in batches]),
        **{f"column/{name}": torch.cat([batch.columns[name] for batch in batches]) for name in batches[0].columns},
    }
    gathered = parallel.gather_objects(local)  # small per-completion vectors
    every = {key: torch.cat([part[key] for part in gathered]) for key in local}
    rewards, lengths = every["rewards"], every["lengths"]
    columns = {key.removeprefix("column/"): value for key, value in every.items() if key.startswith("column/")}
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "accuracy": every["correct"].float().mean().item(),
        "completion_length/mean": lengths.mean().item(),
        "completion_length/min": lengths.min().item(),
        "completion_length/max": lengths.max().item(),
        "truncated_fraction": every["truncated"].float().mean().item(),
        "zero_spread_group_fraction": core.zero_spread_groups(rewards, alg.group_size).float().mean().item(),
        **column_metrics(columns),
    }
    metrics.update(tool_metrics(seen))
    unscorable = parallel.sum_over_ranks({"reward/unscorable": float(sum(entry.unscorable for entry in seen))})
    if unscorable["reward/unscorable"]:
        metrics.update(unscorable)
    failures = {
        f"reward/{name}/failures/{kind}": float(count)
        for name, counts in reward_set.failure_counts().items()
        for kind, count in counts.items()
    }
    for part in parallel.gather_objects(failures):  # kinds differ between ranks, so gather rather than all-reduce
        for key, count in part.items():
            metrics[key] = metrics.get(key, 0.0) + count
    if reward_set.on_error == "zero":
        reward_errors = [error for entry in seen for error in entry.errors]
        counts = {"reward/errors": float(len(reward_errors))}
        for name in reward_set.names:
            counts[f"reward/{name}/errors"] = float(sum(error.reward_name == name for error in reward_errors))
        metrics.update(parallel.sum_over_ranks(counts))
    if alg.dynamic_sampling:
        metrics.update(
            {
                "dynamic_sampling/rounds": len(seen),
                **parallel.sum_over_ranks({"dynamic_sampling/groups_kept": kept_groups}),
            }
        )
    return metrics


def column_metrics(columns: dict[str, torch.Tensor]) -> dict[str, float]:
    """Return each reward's mean and std over the samples it applied to (NaN marks TRL's None, "does not apply")."""
    metrics = {}
    for name, column in columns.items():
        applied = column[~column.isnan()].float()
        if len(applied):
            metrics[f"reward/{name}/mean"] = applied.mean().item()
            metrics[f"reward/{name}/std"] = applied.std().item() if len(applied) > 1 else 0.0
    return metrics


def tool_metrics(seen: list[ScoredRound]) -> dict:
    """Return the tool use of every rank's episodes in these rounds (`polo.generation.episodes.episode_metrics`).

    Empty for one-turn completions.
    """
    local = [
        (episode, float(value))
        for entry in seen
        if entry.batch.rollouts.episodes is not None
        for episode, value in zip(entry.batch.rollouts.episodes, entry.correct.tolist())
    ]
    pairs = [pair for part in parallel.gather_objects(local) for pair in part]
    if not pairs:
        return {}
    return episode_metrics([episode for episode, _ in pairs], [value for _, value in pairs])


def reward_error_messages(run: Run, seen: list[ScoredRound]) -> list[str]:
    """Return the warnings for reward functions that failed and scored 0 (the first few: one broken function can
    fail every sample), and for completions that no reward applied to (every TRL-form reward returned None)."""
    unscorable = sum(entry.unscorable for entry in seen)
    messages = (
        [f"polo: warning: {unscorable} completion(s) had every reward return None (none applies); they total 0"]
        if unscorable
        else []
    )
    if run.reward_set.on_error != "zero":
        return messages
    reward_errors = [error for entry in seen for error in entry.errors]
    return messages + [f"polo: warning: scored 0: {error}" for error in reward_errors[:3]]


def sample_log_rows(step: int, scored: ScoredRound) -> list[dict]:
    """Return the best and the worst completion of a round as `samples.jsonl` rows (for reports)."""
    batch = scored.batch
    rollouts, rewards = batch.rollouts, batch.rewards
    picks = {"best": int(rewards.argmax()), "worst": int(rewards.argmin())}
    episodes = rollouts.episodes
    return [
        {
            "step": step,
            "kind": kind,
            "prompt": batch.prompts[index // rollouts.group_size],
            # An episode's whole transcript (turns and observations); its last turn is what was graded.
            "completion": rollouts.texts[index] if episodes is None else episodes[index].transcript,
            "reward": float(rewards[index]),
            "rewards": {name: _logged(float(column[index])) for name, column in batch.columns.items()},
            "correct": float(scored.correct[index]),
        }
        for kind, index in picks.items()
    ]


def completion_rows(batch: Batch, advantages: torch.Tensor) -> list[dict]:
    """Return a completions-table row per completion of `batch`.

    Each row holds the prompt, the completion, the reward in total and per function, and the advantage:
    the mean over the completion's tokens (its sequence advantage under GRPO-style estimators).
    """
    rollouts, mask = batch.rollouts, batch.rollouts.completion_mask.float()
    per_completion = ((advantages.float() * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    rewards = batch.rewards.tolist()
    columns = {
        f"reward/{name}": [_logged(value) for value in column.tolist()]
        for name, column in (batch.columns or {}).items()
    }
    return [
        {
            "prompt": batch.prompts[index // rollouts.group_size],
            "completion": text,
            "reward": rewards[index],
            **{name: values[index] for name, values in columns.items()},
            "advantage": per_completion[index],
        }
        for index, text in enumerate(rollouts.texts)
    ]


def _logged(value: float) -> float | None:
    """Return a reward value as logged: None where the reward did not apply (NaN), which JSON cannot hold."""
    return None if math.isnan(value) else value


def score_before_update(run: Run, rollouts: Rollouts) -> PreUpdateScores:
    """Return the reference log-probs, the old log-probs and the critic's old values the step needs.

    The reference is scored only when beta > 0; old log-probs only when the update needs them
    (more than one optimizer step per batch, `polo.rl.update.optimizer_steps_per_batch`, or the KL
    folded into the rewards); old values only with a critic.
    """
    alg, micro_batch_size, temperature = (
        run.config.algorithm,
        run.config.train.micro_batch_size,
        run.config.sampling.temperature,
    )
    scores = PreUpdateScores()
    if alg.beta > 0:
        with reference_scope(run.model, run.reference):  # the LoRA policy itself, adapters off
            scores.reference_logprobs = score_completions(
                run.reference, rollouts, micro_batch_size, run.compute, temperature
            )
    if run.critic is not None:
        scores.old_values, scores.old_logprobs = run.critic.score(
            run.model, rollouts, micro_batch_size, run.compute, temperature
        )
    # the sampler correction compares the sampler's log-probs with the training forward's, even on-policy
    needs_old = optimizer_steps_per_batch(run.config) > 1 or alg.kl_in_reward or alg.sampler_correction is not None
    if scores.old_logprobs is None and needs_old:
        with parallel.gathered_weights(run.model):
            scores.old_logprobs = score_completions(run.model, rollouts, micro_batch_size, run.compute, temperature)
    return scores


def scored_rows(columns: dict[str, torch.Tensor], reward_names: Sequence[str]) -> torch.Tensor | None:
    """Return (batch,) bool, False where every reward function returned None (NaN in each of their columns); None
    when every completion was scored."""
    own = [columns[name] for name in reward_names if name in columns]
    if not own:
        return None
    scored = ~torch.stack([column.isnan() for column in own]).all(dim=0)
    return None if bool(scored.all()) else scored


def reward_terms(
    columns: dict[str, torch.Tensor], reward_weights: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Return the terms the total reward sums, `(batch, K)`, and their weights `(K,)`: each reward function's column
    with its weight, and each shaping column (overlong, an environment's own reward) with weight 1; (None, None)
    for a batch without columns."""
    if not columns:
        return None, None
    stacked = torch.stack(list(columns.values()), dim=1)
    weights = [float(reward_weights.get(name, 1.0)) for name in columns]
    return stacked, torch.tensor(weights, dtype=stacked.dtype, device=stacked.device)


def compute_advantages(
    batch: Batch, scores: PreUpdateScores, config: Config, reward_weights: Mapping[str, float] | None = None
) -> UpdateBatch:
    """Return the update's batch: the rollouts, advantages from the registered estimator and the losses' targets.

    `reward_weights` names the reward functions among `batch.columns` with their weights: their None (NaN)
    marks a completion none of them applied to (`scored_rows`), and an estimator that treats the rewards apart
    reads each one's column (`reward_terms`)."""
    alg = config.algorithm
    kl = (
        core.kl_estimate(scores.old_logprobs, scores.reference_logprobs, alg.kl_estimator) if alg.kl_in_reward else None
    )
    reward_weights = reward_weights or {}
    reward_columns, weights = reward_terms(batch.columns or {}, reward_weights)
    inputs = core.AdvantageInputs(
        batch.rewards,
        batch.rollouts.completion_mask.float(),
        alg.group_size,
        kl=kl,
        values=scores.old_values,
        scored=scored_rows(batch.columns or {}, list(reward_weights)),
        reward_columns=reward_columns,
        reward_weights=weights,
    )
    advantages, returns = core.ADVANTAGE_ESTIMATORS[alg.advantage_estimator](inputs, alg)
    return UpdateBatch(
        batch.rollouts,
        advantages,
        old_logprobs=scores.old_logprobs,
        reference_logprobs=scores.reference_logprobs,
        old_values=scores.old_values,
        returns=returns,
    )


def skipped_step(run: Run, sampled: SampledStep, timings: dict) -> StepResult:
    """Return the result of a step with no update: dynamic sampling found no informative group within its cap."""
    metrics = {
        **sampled.metrics,
        "update_skipped": 1.0,
        "learning_rate": run.scheduler.get_last_lr()[0],
        **{f"time/{k}": v for k, v in timings.items()},
    }
    metrics["time/step"] = sum(timings.values())
    return StepResult(parallel.combine_metrics(parallel.gather_objects(metrics)), sampled.samples, [], sampled.messages)


def rl_step(run: Run, step: int) -> StepResult:
    """Run one sampling + update step in place; return its metrics row, sample rows and messages, combined over ranks.

    When a tracker in `output.report_to` keeps tables, the result also holds a `completion_rows`
    row for every completion the step trained on, from every rank.
    """
    alg, timings = run.config.algorithm, {}
    sampled = collect_batch(run, step, timings)
    batch = align_groups(sampled.batch, alg.group_size) if alg.dynamic_sampling else sampled.batch
    if batch is None:
        return skipped_step(run, sampled, timings)
    rollouts = batch.rollouts

    started = time.perf_counter()
    config = run.step_config  # the recipe, with the adaptive controller's KL coefficient
    update_batch = compute_advantages(batch, score_before_update(run, rollouts), config, run.reward_set.weights)
    timings["reference"] = time.perf_counter() - started
    advantages = update_batch.advantages
    completions = completion_rows(batch, advantages) if logs_tables(run.config.output.report_to) else None

    started = time.perf_counter()
    train_policy = run.critic is None or run.critic.trains_policy(step)
    update_metrics = policy_update(run.learner, update_batch, config, train_policy=train_policy)
    timings["update"] = time.perf_counter() - started

    total_time = sum(timings.values())
    # Real prompt + completion tokens of every row (no padding), once per pass over the batch: what
    # an SFT step's tokens_per_second counts (polo.finetune.fit), so the two rates compare.
    real_tokens = float(rollouts.completion_mask.sum() + rollouts.prompt_mask.sum())
    group = rollouts.group_size if len(rollouts) % max(rollouts.group_size, 1) == 0 else 1
    metrics = {
        **sampled.metrics,
        "advantage/abs_mean": core.masked_mean(advantages.abs(), rollouts.model_token_mask).item(),
        "learning_rate": run.scheduler.get_last_lr()[0],
        **update_metrics,
        **{f"time/{name}": seconds for name, seconds in timings.items()},
        "time/step": total_time,
        "tokens_per_second": real_tokens / max(total_time, 1e-9),
        "update_tokens_per_second": real_tokens * alg.update_epochs / max(timings["update"], 1e-9),
        "floor_tokens": least_tokens(rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_mask, group),
        **memory_metrics(run.compute),  # the device's peak since the last step (CUDA only)
    }
    if update_batch.returns is not None:
        old_values, mask = update_batch.old_values, rollouts.completion_mask
        metrics["value/explained_variance"] = core.explained_variance(old_values, update_batch.returns, mask)
        metrics["value/mean"] = core.masked_mean(old_values, mask).item()
    result = StepResult(parallel.combine_metrics(parallel.gather_objects(metrics)), sampled.samples)
    result.messages = sampled.messages
    if completions is not None:  # every rank's, for a tracker's completions table
        result.completions = [row for part in parallel.gather_objects(completions) for row in part]
    adapt_kl_coefficient(run, result.metrics, len(rollouts))
    sync_reference(run, step)
    return result


def adapt_kl_coefficient(run: Run, metrics: dict, completions: int) -> None:
    """Under the adaptive KL controller (`algorithm.kl_target`), log the step's KL coefficient as `beta` and move it
    for the next step from the step's `kl`, measured over every rank's `completions` (`core.adaptive_kl_coefficient`).
    """
    alg = run.config.algorithm
    if alg.kl_target is None:
        return
    samples = parallel.sum_over_ranks({"completions": float(completions)})["completions"]
    metrics["beta"] = run.beta
    kl = metrics.get("kl")
    if kl is not None and math.isfinite(kl):
        run.beta = core.adaptive_kl_coefficient(run.beta, kl, alg.kl_target, alg.kl_horizon, int(samples))


def sync_reference(run: Run, step: int) -> None:
    """With `algorithm.sync_ref_model`, after every `ref_model_sync_steps`-th step move the reference toward the
    policy (TR-DPO's soft update, `core.mix_into_reference`); every rank holds the whole reference and mixes alike."""
    alg = run.config.algorithm
    if not alg.sync_ref_model or step % alg.ref_model_sync_steps:
        return
    policy = dict(run.model.named_parameters())
    names = [name for name, _ in run.reference.named_parameters()]
    core.mix_into_reference(
        (parameter for _, parameter in run.reference.named_parameters()),
        (policy[name] for name in names),
        alg.ref_model_mixup_alpha,
    )


def least_tokens(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor, group: int
) -> float:
    """Return the fewest tokens a step must run through the model: the completions, each group's prompt once, and
    the prefix all the groups' prompts open with (a system prompt) once: the compute floor's T
    (benchmarks/grpo_vs_trl.py, benchmarks/demo_floor.py).

    prompt_ids, prompt_mask (batch, P) left-padded; completion_mask (batch, C); groups of `group` consecutive rows.
    """
    prompts, masks = prompt_ids[::group], prompt_mask[::group]
    shared = common_prefix_length(prompts, masks) if prompts.shape[0] > 1 else 0
    return float(completion_mask.sum() + masks.sum() - (prompts.shape[0] - 1) * shared)
