"""The policy update: `update_epochs` passes of minibatch optimizer steps over one batch of whole groups.

Per micro-batch: log-probs under the current policy -> registered policy loss (PPO clip, GSPO,
...) -> + beta * KL to the reference -> registered aggregation (− entropy_coef * mean entropy) -> backward. Normalisers
(sequences, valid tokens) are global per optimizer step: counted over the whole minibatch and all
ranks through `polo.core.global_count`, so gradient accumulation over micro-batches gives exactly
the full-minibatch gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from polo import core
from polo.config import Config
from polo.config.validation import bind_options
from polo.generation.rollouts import Rollouts
from polo.kernels import attends_blockwise
from polo.models.critic import completion_values
from polo.models.loading import recompute_scope
from polo.models.routing import RoutingSums, recorded_routing
from polo.rl.batching import UpdateBatch, micro_batches, trim_padding
from polo.rl.critic import Critic, value_loss
from polo.rl.modules import UpdateModules, build_update_modules
from polo.runtime import parallel
from polo.runtime.device import Compute
from polo.runtime.errors import NonFiniteLossError

SUM_KEYS = (
    "kl",
    "entropy",
    "clip_low",
    "clip_high",
    "ratio",
    "approx_kl",
    "tokens",
    "loss",
    "grad_norm",
    "value_loss",
    "critic_grad_norm",
    "off_policy_masked",
    "sampler_gap",
    "sampler_tokens",
)


def optimizer_steps_per_batch(config: Config) -> int:
    """Return how many optimizer steps train on one sampled batch: `update_epochs` x `train.num_minibatches`.

    When it is more than one, every step after the first trains a policy that has already moved
    since sampling, so its importance ratio must be taken against log-probs scored under the
    sampling policy before the update (GRPO's π_old, Shao et al. 2024 eq. 3; GSPO's, Zheng et al.
    2025 eq. 5). With exactly one, the policy is still the sampling one and the ratio is 1.
    """
    return config.algorithm.update_epochs * config.train.num_minibatches


def update_modules(model, critic: Critic | None) -> UpdateModules:
    """Return the modules policy updates run through (DDP-wrapped inside a process group; build once per run)."""
    head = critic.value_head if critic is not None else None
    # A value head warming up alone leaves the policy's weights without gradients, which DDP must be told.
    find_unused = head is not None and critic.warmup_steps > 0
    return build_update_modules(
        model, head, critic.value_model if critic is not None else None, find_unused_parameters=find_unused
    )


def backward_checked(loss: torch.Tensor, optimizer, scheduler, loss_scale: float = 1.0) -> None:
    """Backpropagate `loss_scale * loss`, or raise `NonFiniteLossError` (after dropping the gradients) when
    the loss is NaN or infinite on any rank (the decision is collective, so no rank waits alone in a backward)."""
    if parallel.any_rank(not bool(torch.isfinite(loss))):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(
            f"loss is {loss.item()} on rank {parallel.rank()} (optimizer step {scheduler.last_epoch + 1}); "
            "a rank had a non-finite loss, the update was not applied and the last checkpoint is intact. "
            "Try a lower train.learning_rate or check the reward functions."
        )
    if loss.requires_grad:
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()


@dataclass
class Learner:
    """What a policy update changes and runs through: the policy, its optimizer and schedule, the critic."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    compute: Compute  # the device and precision the update runs in
    critic: Critic | None = None  # PPO's value function (None for critic-free estimators)
    modules: UpdateModules | None = None  # what forward and backward run through; built plain when None


class UpdateContext:
    """What every micro-batch of one `policy_update` call shares: the learner, the batch and running sums."""

    def __init__(self, learner: Learner, batch: UpdateBatch, config: Config, train_policy: bool):
        self.learner, self.batch, self.train_policy = learner, batch, train_policy
        self.rollouts, self.advantages = batch.rollouts, batch.advantages
        self.old_logprobs, self.ref_logprobs = batch.old_logprobs, batch.reference_logprobs
        self.config, self.alg, self.compute, self.critic = config, config.algorithm, learner.compute, learner.critic
        self.modules = learner.modules if learner.modules is not None else update_modules(learner.model, learner.critic)
        self.loss_mask = self.rollouts.model_token_mask.float()  # an episode's tool output and template: context only
        if self.alg.mask_truncated:  # DAPO's overlong filtering: truncated completions teach nothing
            self.loss_mask = self.loss_mask * (~self.rollouts.truncated).float().unsqueeze(-1)
        self.kl_in_loss = self.ref_logprobs is not None and not self.alg.kl_in_reward
        self.sampler_weights = sampler_weights(self.rollouts, self.old_logprobs, self.loss_mask, self.alg)
        self.policy_loss = bind_options(  # a loss's own options (algorithm.policy_loss_options), checked and bound
            "algorithm.policy_loss_options",
            core.POLICY_LOSSES.entry(self.alg.policy_loss),
            self.alg.policy_loss_options,
            positional=2,
        )
        self.sums = {key: 0.0 for key in SUM_KEYS}
        if self.sampler_weights is not None:  # how far the sampler's log-probs are from the trainer's, once a batch
            width = self.old_logprobs.shape[1]
            gap = (self.old_logprobs - self.rollouts.sampling_logprobs[:, :width]).abs()
            valid = self.loss_mask[:, :width].bool()
            self.sums["sampler_gap"] = float(core.masked_sum(torch.nan_to_num(gap, nan=0.0), valid))
            self.sums["sampler_tokens"] = float(valid.sum())
        self.routing = RoutingSums()


def sampler_weights(
    rollouts: Rollouts, old_logprobs: torch.Tensor | None, mask: torch.Tensor, alg
) -> torch.Tensor | None:
    """Return the batch's sampler-correction weights `(batch, seq)` or `(batch, 1)` (`core.sampler_correction_weights`),
    or None when `algorithm.sampler_correction` is off."""
    if alg.sampler_correction is None:
        return None
    if rollouts.sampling_logprobs is None or old_logprobs is None:
        raise ValueError(
            "algorithm.sampler_correction needs the sampler's log-probs (Rollouts.sampling_logprobs) and the sampling "
            "policy's (UpdateBatch.old_logprobs); this batch lacks one"
        )
    return core.sampler_correction_weights(
        old_logprobs,
        rollouts.sampling_logprobs[:, : old_logprobs.shape[1]],
        mask[:, : old_logprobs.shape[1]],
        alg.sampler_correction,
        alg.sampler_correction_min,
        alg.sampler_correction_max,
    )


def off_policy_kept(ctx: UpdateContext, logprobs, old, advantages, mask, micro) -> torch.Tensor:
    """Return which of the micro-batch's completions `core.off_policy_sequences` keeps, measuring the drift from the
    sampler's log-probs where it recorded them, else from the sampling policy's."""
    sampled = ctx.rollouts.sampling_logprobs
    sampling = old if sampled is None else sampled[micro, : logprobs.shape[1]].to(logprobs.dtype)
    return core.off_policy_sequences(logprobs, sampling, advantages, mask, ctx.alg.off_policy_mask_threshold)


def policy_loss_term(
    ctx: UpdateContext,
    logprobs: torch.Tensor,
    micro: torch.Tensor,
    mask: torch.Tensor,
    normalisers: core.LossNormalisers,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return the aggregated policy loss (+ beta * KL) of one micro-batch and add its statistics to `ctx.sums`.

    With `top_entropy_quantile` < 1 the policy term keeps only the micro-batch's high-entropy tokens (`entropy`,
    `core.high_entropy_tokens`); the KL and the aggregation's counts keep every token, as the paper's objective does.
    So do `off_policy_mask_threshold`, which leaves drifted negative-advantage completions out of the policy term, and
    `sampler_correction`, which weights it by π_old/μ.
    """
    alg, width = ctx.alg, logprobs.shape[1]
    old = ctx.old_logprobs[micro, :width] if ctx.old_logprobs is not None else logprobs.detach()
    token_advantages = ctx.advantages[micro, :width] if ctx.advantages.dim() == 2 else ctx.advantages[micro]
    per_token, stats = ctx.policy_loss(core.PolicyLossInputs(logprobs, old, token_advantages, mask), alg)
    trained = mask  # the tokens the policy term (and the entropy bonus, as in TRL) acts on
    if alg.off_policy_mask_threshold is not None:
        kept = off_policy_kept(ctx, logprobs, old, token_advantages, mask, micro)
        per_token = torch.where(kept, per_token, 0.0)
        ctx.sums["off_policy_masked"] += float((mask.bool() & ~kept).sum())
    if ctx.sampler_weights is not None:
        per_token = per_token * ctx.sampler_weights[micro, :width].to(per_token.dtype)
    if alg.top_entropy_quantile < 1.0 and entropy is not None:
        trained = core.high_entropy_tokens(entropy, mask, alg.top_entropy_quantile)
        per_token = torch.where(trained, per_token, 0.0)
    if ctx.kl_in_loss:
        kl = core.kl_estimate(logprobs, ctx.ref_logprobs[micro, :width], alg.kl_estimator)
        if alg.kl_importance_weighted:
            kl = core.importance_weighted_kl(kl, logprobs, old)
        per_token = per_token + alg.beta * kl
        ctx.sums["kl"] += float((kl.detach() * mask).sum())
    ctx.sums["clip_low"] += float(stats.get("clip_low_count", 0.0))
    ctx.sums["clip_high"] += float(stats.get("clip_high_count", 0.0))
    add_drift(ctx, logprobs.detach(), old, mask, stats)
    loss = core.aggregate_loss(per_token, mask, alg.loss_aggregation, normalisers)
    if alg.entropy_coef > 0:
        loss = loss + core.entropy_bonus(entropy, trained.to(mask.dtype), alg.entropy_coef, normalisers)
    return loss


def add_drift(ctx: UpdateContext, logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, stats: dict) -> None:
    """Add to `ctx.sums` how far the policy being trained has moved from the one that sampled, over `mask`'s tokens:
    the k3 estimate of KL(π_old ‖ π) (`approx_kl`, as `polo control` logs it) and the importance ratio the loss
    took (its `ratio_sum`: GSPO's sequence ratio on each token), or the token ratio π / π_old where it gives none."""
    valid = mask.bool()
    ctx.sums["approx_kl"] += float(core.masked_sum(core.kl_k3(old, logprobs), valid))
    ratio_sum = stats.get("ratio_sum")
    if ratio_sum is None:
        ratio_sum = core.masked_sum(torch.exp(torch.where(valid, logprobs - old, 0.0)), valid)
    ctx.sums["ratio"] += float(ratio_sum)


def trunk_tokens(model: torch.nn.Module, part: Rollouts, group_size: int) -> int:
    """Return the tokens a forward over the micro-batch `part` runs through `model`'s trunk: each group's prompt once
    where attention reads the shared-prompt layout (`polo.kernels.attends_blockwise`), else every row's prompt."""
    prompts = part.prompt_mask
    if group_size > 1 and attends_blockwise(model) and len(part) % group_size == 0:
        prompts = prompts[::group_size]
    return int(prompts.sum() + part.completion_mask.sum())


def micro_batch_step(ctx: UpdateContext, micro: torch.Tensor, normalisers: core.LossNormalisers) -> float:
    """Forward and backward one micro-batch (policy loss, and the critic's value loss); return its loss."""
    alg, critic, modules = ctx.alg, ctx.critic, ctx.modules
    optimizer, scheduler = ctx.learner.optimizer, ctx.learner.scheduler
    part = trim_padding(ctx.rollouts.select(micro))
    mask = ctx.loss_mask[micro, : part.completion_ids.shape[1]]
    inputs = (part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask)
    loss, values = torch.zeros((), device=mask.device), None
    tokens = trunk_tokens(ctx.learner.model, part, ctx.rollouts.group_size)
    if ctx.train_policy or (critic is not None and critic.value_head is not None):
        with (
            ctx.compute.autocast(),
            recompute_scope(ctx.learner.model, tokens),
            recorded_routing(ctx.learner.model) as routing,
        ):
            logprobs, entropy, values = modules.policy(
                *inputs,
                temperature=ctx.config.sampling.temperature,
                detach_trunk_for_values=not ctx.train_policy,
                group_size=ctx.rollouts.group_size,
            )
    if ctx.train_policy:
        # The loss maths in fp32 at least: bf16 log-probs are widened, fp64 ones (an exact comparison) kept.
        logprobs = logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))
        loss = policy_loss_term(ctx, logprobs, micro, mask, normalisers, entropy)
        loss = loss + ctx.routing.add(routing, alg.router_aux_loss_coef, normalisers.num_micro_batches)
        ctx.sums["entropy"] += float((entropy.detach() * mask).sum())
    if values is not None:  # value head on the shared trunk: one backward for both losses
        head_loss = value_loss(values, ctx.batch, micro, mask, alg, normalisers)
        ctx.sums["value_loss"] += float(head_loss.detach())
        loss = loss + alg.value_coef * head_loss
    backward_checked(loss, optimizer, scheduler, modules.loss_scale)
    total = loss.item()
    if critic is not None and critic.value_model is not None:
        # The critic's graph is built only after the policy's is freed: half the peak activations.
        with ctx.compute.autocast(), recompute_scope(critic.value_model, tokens):
            values = completion_values(modules.critic, *inputs)
        critic_loss = alg.value_coef * value_loss(values, ctx.batch, micro, mask, alg, normalisers)
        backward_checked(critic_loss, critic.optimizer, scheduler, modules.loss_scale)
        ctx.sums["value_loss"] += float(critic_loss.detach()) / alg.value_coef
        total += critic_loss.item()
    ctx.sums["tokens"] += float(mask.sum())
    return total


def minibatch_step(ctx: UpdateContext, rows: torch.Tensor) -> None:
    """Accumulate the gradient of minibatch `rows` over its micro-batches, clip it and take one optimizer step."""
    train_config, optimizer, scheduler = ctx.config.train, ctx.learner.optimizer, ctx.learner.scheduler
    micros = micro_batches(rows, train_config.micro_batch_size, ctx.rollouts.group_size)
    normalisers = core.LossNormalisers(
        num_sequences=core.global_count(len(rows)),
        num_tokens=core.global_count(ctx.loss_mask[rows].sum().clamp(min=1.0)),
        max_completion_length=ctx.config.sampling.max_new_tokens,
        num_micro_batches=core.global_count(len(micros)),
    )
    optimizer.zero_grad(set_to_none=True)
    if ctx.critic is not None:
        ctx.critic.zero_grad()
    minibatch_loss = 0.0
    for index, micro in enumerate(micros):
        with ctx.modules.gradient_sync(index == len(micros) - 1):  # gradients all-reduce on the last micro-batch only
            minibatch_loss += micro_batch_step(ctx, micro, normalisers)
    grad_norm = parallel.global_norm(
        torch.nn.utils.clip_grad_norm_(
            [p for group in optimizer.param_groups for p in group["params"]], train_config.max_grad_norm
        )
    )
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(
            f"gradient norm is {grad_norm.item()}; the update was not applied and the last checkpoint is intact"
        )
    if ctx.critic is not None:
        ctx.sums["critic_grad_norm"] += ctx.critic.step(train_config.max_grad_norm)
    optimizer.step()  # parameters without a gradient (the policy during critic warm-up) are left alone
    scheduler.step()
    ctx.sums["loss"] += minibatch_loss
    ctx.sums["grad_norm"] += float(grad_norm)


def update_metrics(ctx: UpdateContext, optimizer_steps: int) -> dict:
    """Return the update's metrics averaged over optimizer steps and tokens of every rank."""
    sums = ctx.sums
    # Per-rank sums -> global sums (gradient norms are already global: measured after the all-reduce).
    sums.update(parallel.sum_over_ranks({key: value for key, value in sums.items() if "grad_norm" not in key}))
    tokens = max(sums["tokens"], 1.0)
    metrics = {"loss": sums["loss"] / optimizer_steps, "grad_norm": sums["grad_norm"] / optimizer_steps}
    if ctx.train_policy:
        metrics.update(
            {
                "entropy": sums["entropy"] / tokens,
                "clip_fraction/low": sums["clip_low"] / tokens,
                "clip_fraction/high": sums["clip_high"] / tokens,
                "approx_kl": sums["approx_kl"] / tokens,
                "ratio/mean": sums["ratio"] / tokens,
            }
        )
        if ctx.alg.off_policy_mask_threshold is not None:
            metrics["off_policy/masked_fraction"] = sums["off_policy_masked"] / tokens
        if ctx.sampler_weights is not None:  # mean |log π_old − log μ| per token: what the correction corrects
            metrics["sampler/logprob_gap"] = sums["sampler_gap"] / max(sums["sampler_tokens"], 1.0)
    if ctx.kl_in_loss and ctx.train_policy:
        metrics["kl"] = sums["kl"] / tokens
    elif ctx.ref_logprobs is not None and ctx.old_logprobs is not None:  # k1 of the sampled batch
        metrics["kl"] = core.masked_mean(ctx.old_logprobs - ctx.ref_logprobs, ctx.rollouts.model_token_mask).item()
    metrics.update(ctx.routing.metrics())
    if ctx.critic is not None:
        metrics["value/loss"] = sums["value_loss"] / optimizer_steps
        if ctx.critic.optimizer is not None:
            metrics["value/grad_norm"] = sums["critic_grad_norm"] / optimizer_steps
    return metrics


def policy_update(learner: Learner, batch: UpdateBatch, config: Config, *, train_policy: bool = True) -> dict:
    """Apply `update_epochs` x `num_minibatches` optimizer steps to `learner` and return averaged update metrics.

    With a critic, `batch.old_values` and `batch.returns` are its targets and the value loss is
    trained alongside; `train_policy=False` (critic warm-up) leaves the policy untouched.
    Forward and backward go through `learner.modules` (DDP-wrapped under torchrun): gradients
    stay local until the last micro-batch of a minibatch, whose backward all-reduces them.
    """
    ctx = UpdateContext(learner, batch, config, train_policy)
    group_size = batch.rollouts.group_size
    num_groups = len(batch.rollouts) // group_size
    groups_per_minibatch = max(math.ceil(num_groups / config.train.num_minibatches), 1)
    optimizer_steps = 0
    for _ in range(config.algorithm.update_epochs):
        for first_group in range(0, num_groups, groups_per_minibatch):
            rows = torch.arange(
                first_group * group_size,
                min(first_group + groups_per_minibatch, num_groups) * group_size,
                device=batch.advantages.device,
            )
            minibatch_step(ctx, rows)
            optimizer_steps += 1
    return update_metrics(ctx, optimizer_steps)
