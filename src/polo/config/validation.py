"""Checks on values that have the right type but make no sense (run before anything loads)."""

from __future__ import annotations

from typing import Any

from polo import core
from polo.config.plugins import check_registered
from polo.config.presets import PRESETS
from polo.config.schema import Config, ConfigError, LoraSettings

_CHOICES = {
    "train.precision": ("auto", "fp32", "bf16", "bf16_master"),
    "train.lr_schedule": ("constant", "linear", "cosine"),
    "train.on_reward_error": ("raise", "zero"),
    "train.data_parallel": ("ddp", "fsdp"),
    "algorithm.name": tuple(PRESETS),
    "algorithm.critic": ("separate", "head"),
}

# Fields that name a registered function (a built-in name, or module:name for a user's own).
_REGISTERED = {
    "advantage_estimator": core.ADVANTAGE_ESTIMATORS,
    "policy_loss": core.POLICY_LOSSES,
    "loss_aggregation": core.LOSS_AGGREGATIONS,
    "kl_estimator": core.KL_ESTIMATORS,
}


def check_lora(lora: LoraSettings) -> None:
    """Raise `ConfigError` for LoRA settings that make no sense."""
    if lora.r < 0:
        raise ConfigError(f"model.lora.r must be >= 0 (0 = full fine-tuning), got {lora.r}")
    if lora.r and lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if lora.r and not lora.target_modules:
        raise ConfigError("model.lora.target_modules is empty; name modules (e.g. [q_proj, v_proj]) or use [all-linear]")


def check_choices(config: Any, choices: dict[str, tuple]) -> None:
    """Raise `ConfigError` for the first `section.field` whose value is not among its allowed choices."""
    for dotted, allowed in choices.items():
        section, name = dotted.split(".")
        value = getattr(getattr(config, section), name)
        if value not in allowed:
            raise ConfigError(f"{dotted}: {value!r} is not one of {', '.join(allowed)}")


def check_at_least_one(values: dict[str, int]) -> None:
    """Raise `ConfigError` for the first `dotted.key` whose integer value is below 1."""
    for key, value in values.items():
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, got {value}")


def validate(config: Config) -> None:
    """Raise `ConfigError` for values that have the right type but make no sense."""
    check_choices(config, _CHOICES)
    for name, registry in _REGISTERED.items():
        check_registered(f"algorithm.{name}", getattr(config.algorithm, name), registry)
    estimator = core.ADVANTAGE_ESTIMATORS.entry(config.algorithm.advantage_estimator)
    check_at_least_one({
        "algorithm.group_size": config.algorithm.group_size,
        "algorithm.update_epochs": config.algorithm.update_epochs,
        "train.prompts_per_step": config.train.prompts_per_step,
        "train.num_minibatches": config.train.num_minibatches,
        "train.micro_batch_size": config.train.micro_batch_size,
        "train.max_nonfinite_steps": config.train.max_nonfinite_steps,
        "sampling.max_new_tokens": config.sampling.max_new_tokens,
    })
    if config.train.steps < 0:
        raise ConfigError(f"train.steps must be >= 0, got {config.train.steps}")
    check_lora(config.model.lora)
    if config.model.lora.r and estimator.needs_critic:
        raise ConfigError(
            f"model.lora.r > 0 is not supported with PPO's critic (advantage_estimator {config.algorithm.advantage_estimator}) yet; "
            "use full fine-tuning (model.lora.r=0)"
        )
    if config.model.lora.r and config.train.data_parallel == "fsdp":
        raise ConfigError("model.lora.r > 0 is not supported with train.data_parallel=fsdp (the adapters are small: use ddp)")
    if config.algorithm.group_size < 2 and config.algorithm.scale_rewards and config.algorithm.advantage_estimator == "grpo":
        raise ConfigError("algorithm.group_size must be at least 2 for group-relative advantages")
    if config.train.prompts_per_step % config.train.num_minibatches:
        raise ConfigError(
            f"train.prompts_per_step ({config.train.prompts_per_step}) must be divisible by "
            f"train.num_minibatches ({config.train.num_minibatches}) so groups are never split"
        )
    if not 0.0 < config.sampling.top_p <= 1.0:
        raise ConfigError(f"sampling.top_p must be in (0, 1], got {config.sampling.top_p}")
    if config.sampling.temperature <= 0:
        raise ConfigError(f"sampling.temperature must be > 0, got {config.sampling.temperature}")
    if config.algorithm.beta < 0:
        raise ConfigError(f"algorithm.beta must be >= 0, got {config.algorithm.beta}")
    if not 0.0 <= config.algorithm.overlong_buffer < 1.0:
        raise ConfigError(f"algorithm.overlong_buffer is a fraction of sampling.max_new_tokens in [0, 1), got {config.algorithm.overlong_buffer}")
    if config.algorithm.max_sampling_rounds < 1:
        raise ConfigError(f"algorithm.max_sampling_rounds must be at least 1, got {config.algorithm.max_sampling_rounds}")
    if config.algorithm.advantage_estimator == "rloo" and config.algorithm.group_size < 2:
        raise ConfigError("algorithm.group_size must be at least 2 for the RLOO leave-one-out baseline")
    if config.algorithm.kl_in_reward and not estimator.token_level:
        token_level = [name for name in core.ADVANTAGE_ESTIMATORS.names() if core.ADVANTAGE_ESTIMATORS.entry(name).token_level]
        raise ConfigError(f"algorithm.kl_in_reward needs a token-level estimator (advantage_estimator {' or '.join(token_level)})")
    if config.algorithm.kl_in_reward and config.algorithm.beta == 0:
        raise ConfigError("algorithm.kl_in_reward needs algorithm.beta > 0 (the KL coefficient in the reward)")
    if not config.rewards:
        raise ConfigError("rewards: at least one reward function is needed, e.g. {correct: 1.0}")
