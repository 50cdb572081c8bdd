"""One RL step, top to bottom: sample -> score -> (reference / old log-probs) -> advantages -> update.

`rl_step(run, step)` is the whole of it; each stage is a function below. Under torchrun every
rank samples and scores its own share of the step's prompts (whole groups), and the metrics are
combined over all ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from polo import core
from polo.config import Config
from polo.generation.episodes import episode_metrics
from polo.generation.rollouts import Rollouts
from polo.models.lora import merged_for_sampling, reference_scope
from polo.models.scoring import completion_logprobs
from polo.rl.batching import Batch, align_groups, batch_rows, concat_rollouts, micro_batches, on_device, trim_padding
from polo.rl.setup import Run
from polo.rl.update import policy_update
from polo.runtime import distributed as parallel
from polo.runtime.device import Compute, memory_metrics
from polo.runtime.trackers import logs_tables


@contextmanager
def sampling_weights(model) -> Iterator[torch.nn.Module]:
    """Yield the module sampling and evaluation run on: whole weights (gathered under FSDP), LoRA adapters merged in."""
    with parallel.gathered_weights(model), merged_for_sampling(model) as sampler:
        yield sampler


@torch.no_grad()
def score_completions(
    model, rollouts: Rollouts, micro_batch_size: int, compute: Compute, temperature: float
) -> torch.Tensor:
    """Return per-token log-probs of every completion under `model` (no gradient), (batch, completion_len) on the rollouts' device."""
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


def sample_and_score(run: Run, step: int, round_index: int, timings: dict) -> dict:
    """Sample this rank's share of the step's prompts (draw `round_index`) and score them.

    Returns the round as a dict: rollouts, prompts, rewards (batch,) with shaping, per-function
    reward columns, and correctness (batch,). Adds the seconds to `timings`.
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
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            compute=run.compute,
            rows=row_batch,
        )
    rollouts = on_device(rollouts, run.compute.device)  # the one place a step's data is put on the run's device
    timings["generation"] += time.perf_counter() - started
    started = time.perf_counter()
    # Each row also carries the exact prompt text the policy saw, for rewards that read it (a learned reward model).
    rows = [{"prompt_text": prompt, **row} for row, prompt in zip(row_batch, prompts) for _ in range(alg.group_size)]
    rewards, columns = run.reward_set.score(rollouts.texts, rows, run.compute.device)
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
    return {
        "rollouts": rollouts,
        "prompts": prompts,
        "rewards": rewards,
        "columns": columns,
        "correct": correct,
        "errors": errors,
    }


def collect_batch(run: Run, step: int, timings: dict) -> tuple[Batch | None, dict, list[dict]]:
    """Sample and score this step's groups; return (batch to train on, sampling metrics, sample log rows).

    With `algorithm.dynamic_sampling` (DAPO), groups whose rewards are all equal are dropped and
    more prompts are sampled, up to `max_sampling_rounds` rounds, until `prompts_per_step`
    informative groups are in hand (fewer if the cap is reached). Metrics describe every
    completion sampled, so the reward curve is the policy's, not the filter's.
    """
    timings.setdefault("generation", 0.0)
    timings.setdefault("reward", 0.0)
    alg, group_size = run.config.algorithm, run.config.algorithm.group_size
    wanted = run.config.train.prompts_per_step // parallel.world_size()  # this rank's groups
    kept: list[tuple[Rollouts, torch.Tensor, list[str], dict]] = []
    seen: list[dict] = []
    kept_groups = 0
    for round_index in range(alg.max_sampling_rounds if alg.dynamic_sampling else 1):
        scored = sample_and_score(run, step, round_index, timings)
        seen.append(scored)
        rollouts, rewards = scored["rollouts"], scored["rewards"]
        keep = (
            core.informative_rows(rewards, group_size)
            if alg.dynamic_sampling
            else torch.arange(len(rollouts), device=rewards.device)
        )
        keep = keep[: (wanted - kept_groups) * group_size]
        if len(keep):
            prompts = [scored["prompts"][int(i)] for i in keep[::group_size] // group_size]
            kept.append(
                (
                    rollouts.select(keep),
                    rewards[keep],
                    prompts,
                    {name: column[keep] for name, column in scored["columns"].items()},
                )
            )
            kept_groups += len(keep) // group_size
        if kept_groups >= wanted:
            break
    batch = None
    if kept:
        columns = {name: torch.cat([part[3][name] for part in kept]) for name in kept[0][3]}
        batch = Batch(
            concat_rollouts([part[0] for part in kept]),
            torch.cat([part[1] for part in kept]),
            [p for part in kept for p in part[2]],
            columns,
        )
    metrics = sampling_metrics(run, seen, kept_groups)
    first = seen[0]
    samples = sample_log_rows(
        step, first["rollouts"], first["prompts"], first["rewards"], first["columns"], first["correct"]
    )
    return batch, metrics, samples


def sampling_metrics(run: Run, seen: list[dict], kept_groups: int) -> dict:
    """Return the step's reward, accuracy, length and failure metrics over every completion of every rank."""
    alg, reward_set = run.config.algorithm, run.reward_set
    local = {
        "rewards": torch.cat([entry["rewards"] for entry in seen]),
        "correct": torch.cat([entry["correct"] for entry in seen]),
        "lengths": torch.cat([entry["rollouts"].completion_lengths for entry in seen]).float(),
        "truncated": torch.cat([entry["rollouts"].truncated for entry in seen]),
        **{f"column/{name}": torch.cat([entry["columns"][name] for entry in seen]) for name in seen[0]["columns"]},
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
        **{f"reward/{name}/mean": column.float().mean().item() for name, column in columns.items()},
        **{
            f"reward/{name}/std": column.float().std().item() if len(column) > 1 else 0.0
            for name, column in columns.items()
        },
    }
    metrics.update(tool_metrics(seen))
    failures = {
        f"reward/{name}/failures/{kind}": float(count)
        for name, counts in reward_set.failure_counts().items()
        for kind, count in counts.items()
    }
    for part in parallel.gather_objects(failures):  # kinds differ between ranks, so gather rather than all-reduce
        for key, count in part.items():
            metrics[key] = metrics.get(key, 0.0) + count
    if reward_set.on_error == "zero":
        reward_errors = [error for entry in seen for error in entry["errors"]]
        counts = {"reward/errors": float(len(reward_errors))}
        for name in reward_set.names:
            counts[f"reward/{name}/errors"] = float(sum(error.reward_name == name for error in reward_errors))
        metrics.update(parallel.sum_over_ranks(counts))
        # Shown to the user by the training loop (first few only: one broken function can fail every sample).
        metrics["_messages"] = [f"polo: warning: scored 0: {error}" for error in reward_errors[:3]]
    if alg.dynamic_sampling:
        metrics.update(
            {
                "dynamic_sampling/rounds": len(seen),
                **parallel.sum_over_ranks({"dynamic_sampling/groups_kept": kept_groups}),
            }
        )
    return metrics


def tool_metrics(seen: list[dict]) -> dict:
    """Return the tool use of every rank's episodes this step (`polo.generation.episodes.episode_metrics`), {} for one turn."""
    local = [
        (episode, float(value))
        for entry in seen
        if entry["rollouts"].episodes is not None
        for episode, value in zip(entry["rollouts"].episodes, entry["correct"].tolist())
    ]
    pairs = [pair for part in parallel.gather_objects(local) for pair in part]
    if not pairs:
        return {}
    return episode_metrics([episode for episode, _ in pairs], [value for _, value in pairs])


def sample_log_rows(step: int, rollouts: Rollouts, prompts: list[str], rewards, columns: dict, correct) -> list[dict]:
    """Return the best and the worst completion of the step as `samples.jsonl` rows (for reports)."""
    picks = {"best": int(rewards.argmax()), "worst": int(rewards.argmin())}
    episodes = rollouts.episodes
    return [
        {
            "step": step,
            "kind": kind,
            "prompt": prompts[index // rollouts.group_size],
            # An episode's whole transcript (turns and observations); its last turn is what was graded.
            "completion": rollouts.texts[index] if episodes is None else episodes[index].transcript,
            "reward": float(rewards[index]),
            "rewards": {name: float(column[index]) for name, column in columns.items()},
            "correct": float(correct[index]),
        }
        for kind, index in picks.items()
    ]


def completion_rows(batch: Batch, advantages: torch.Tensor) -> list[dict]:
    """Return a completions-table row per completion of `batch`: prompt, completion, reward in total and per function, advantage.

    The advantage is the mean over the completion's tokens (its sequence advantage under GRPO-style estimators).
    """
    rollouts, mask = batch.rollouts, batch.rollouts.completion_mask.float()
    per_completion = ((advantages.float() * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    rewards = batch.rewards.tolist()
    columns = {f"reward/{name}": column.tolist() for name, column in (batch.columns or {}).items()}
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


def reference_and_old(
    run: Run, rollouts: Rollouts
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Return (reference log-probs, old log-probs, old values), each (batch, completion_len) or None when not needed.

    The reference is scored only when beta > 0; old log-probs only when the update needs them
    (update_epochs > 1, or the KL folded into the rewards); old values only with a critic.
    """
    alg, micro_batch_size, temperature = (
        run.config.algorithm,
        run.config.train.micro_batch_size,
        run.config.sampling.temperature,
    )
    ref_logprobs = old_logprobs = old_values = None
    if alg.beta > 0:
        with reference_scope(run.model, run.reference):  # the LoRA policy itself, adapters off
            ref_logprobs = score_completions(run.reference, rollouts, micro_batch_size, run.compute, temperature)
    if run.critic is not None:
        old_values, old_logprobs = run.critic.score(run.model, rollouts, micro_batch_size, run.compute, temperature)
    if old_logprobs is None and (alg.update_epochs > 1 or alg.kl_in_reward):
        with parallel.gathered_weights(run.model):
            old_logprobs = score_completions(run.model, rollouts, micro_batch_size, run.compute, temperature)
    return ref_logprobs, old_logprobs, old_values


def compute_advantages(
    batch: Batch, old_logprobs, ref_logprobs, old_values, config: Config
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (per-token advantages (batch, completion_len), value targets or None) from the registered estimator."""
    alg = config.algorithm
    kl = core.kl_estimate(old_logprobs, ref_logprobs, alg.kl_estimator) if alg.kl_in_reward else None
    inputs = core.AdvantageInputs(
        batch.rewards, batch.rollouts.completion_mask.float(), alg.group_size, kl=kl, values=old_values
    )
    return core.ADVANTAGE_ESTIMATORS[alg.advantage_estimator](inputs, alg)


def rl_step(run: Run, step: int) -> tuple[dict, list[dict]]:
    """Run one sampling + update step in place; return (metrics row, sample log rows), combined over ranks.

    When a tracker in `output.report_to` keeps tables, the row also holds `_completions`: a
    `completion_rows` row for every completion the step trained on, from every rank.
    """
    alg, timings = run.config.algorithm, {}
    batch, metrics, samples = collect_batch(run, step, timings)
    batch = align_groups(batch, alg.group_size) if alg.dynamic_sampling else batch
    if batch is None:  # dynamic sampling found no informative group within its cap
        metrics.update(
            {
                "update_skipped": 1.0,
                "learning_rate": run.scheduler.get_last_lr()[0],
                **{f"time/{k}": v for k, v in timings.items()},
            }
        )
        metrics["time/step"] = sum(timings.values())
        return parallel.combine_metrics(parallel.gather_objects(metrics)), samples
    rollouts = batch.rollouts

    started = time.perf_counter()
    ref_logprobs, old_logprobs, old_values = reference_and_old(run, rollouts)
    advantages, returns = compute_advantages(batch, old_logprobs, ref_logprobs, old_values, run.config)
    timings["reference"] = time.perf_counter() - started
    completions = completion_rows(batch, advantages) if logs_tables(run.config.output.report_to) else None

    started = time.perf_counter()
    update_metrics = policy_update(
        run.model,
        run.optimizer,
        run.scheduler,
        rollouts,
        advantages,
        old_logprobs,
        ref_logprobs,
        run.config,
        run.compute,
        critic=run.critic,
        value_targets=(old_values, returns) if run.critic is not None else None,
        train_policy=run.critic is None or run.critic.trains_policy(step),
        modules=run.modules,
    )
    timings["update"] = time.perf_counter() - started

    total_time = sum(timings.values())
    metrics.update(
        {
            "advantage/abs_mean": core.masked_mean(advantages.abs(), rollouts.model_token_mask).item(),
            "learning_rate": run.scheduler.get_last_lr()[0],
            **update_metrics,
            **{f"time/{name}": seconds for name, seconds in timings.items()},
            "time/step": total_time,
            "tokens_per_second": float(rollouts.completion_mask.sum() + rollouts.prompt_mask.sum())
            / max(total_time, 1e-9),
            **memory_metrics(run.compute),  # the device's peak since the last step (CUDA only)
        }
    )
    if returns is not None:
        metrics["value/explained_variance"] = core.explained_variance(old_values, returns, rollouts.completion_mask)
        metrics["value/mean"] = core.masked_mean(old_values, rollouts.completion_mask).item()
    combined = parallel.combine_metrics(parallel.gather_objects(metrics))
    if completions is not None:  # every rank's, for a tracker's completions table; the training loop logs and drops it
        combined["_completions"] = [row for part in parallel.gather_objects(completions) for row in part]
    return combined, samples
