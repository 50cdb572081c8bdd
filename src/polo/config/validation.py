"""Checks on values that have the right type but make no sense (run before anything loads)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polo import core
from polo.config.plugins import check_registered
from polo.config.presets import PRESETS
from polo.config.schema import Config, ConfigError, LoraSettings

_CHOICES = {
    "train.precision": ("auto", "fp32", "bf16", "bf16_master"),
    "train.lr_schedule": ("constant", "linear", "cosine"),
    "train.on_reward_error": ("raise", "zero"),
    "train.on_divergence": ("rollback", "stop"),
    "train.data_parallel": ("ddp", "fsdp"),
    "algorithm.name": tuple(PRESETS),
    "algorithm.critic": ("separate", "head"),
    "sampling.sampler": ("auto", "kv_cache", "static"),  # polo.generation.grouped.SAMPLERS
}

# Fields that name a registered function (a built-in name, or module:name for a user's own).
_REGISTERED = {
    "advantage_estimator": core.ADVANTAGE_ESTIMATORS,
    "policy_loss": core.POLICY_LOSSES,
    "loss_aggregation": core.LOSS_AGGREGATIONS,
    "kl_estimator": core.KL_ESTIMATORS,
}


# What each float of a run may be, beyond finite: "> 0" / ">= 0", or an interval such as "[0, 1)".
# A float that is not named here is only checked to be finite (a NaN or inf passes every comparison
# silently or fails deep inside a step, so it is never a meaningful setting).
_FLOAT_RANGES = {
    "model.lora.dropout": "[0, 1)",
    "sampling.temperature": "> 0",
    "sampling.top_p": "(0, 1]",
    "task.environment.timeout_s": "> 0",
    "algorithm.advantage_eps": ">= 0",
    "algorithm.clip_eps_low": ">= 0",
    "algorithm.clip_eps_high": ">= 0",
    "algorithm.beta": ">= 0",
    "algorithm.overlong_buffer": "[0, 1)",
    "algorithm.overlong_penalty": ">= 0",
    "algorithm.gamma": "[0, 1]",
    "algorithm.lam": "[0, 1]",
    "algorithm.critic_learning_rate": ">= 0",
    "algorithm.value_clip": "> 0",
    "algorithm.value_coef": ">= 0",
    "train.learning_rate": ">= 0",
    "train.weight_decay": ">= 0",
    "train.adam_beta1": "[0, 1)",
    "train.adam_beta2": "[0, 1)",
    "train.max_grad_norm": "> 0",
}

# A Hugging Face Hub repository id, namespace/name: each part 1-96 letters, digits, '_', '-' or '.',
# starting and ending with a letter, digit or '_', with no '--' or '..' (huggingface_hub's rule).
HUB_REPO_ID = re.compile(r"(?!.*(?:--|\.\.))(?=[^/]{1,96}/[^/]{1,96}$)\w(?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?", re.ASCII)


def check_hub_repo(key: str, repo_id: str | None) -> None:
    """Raise `ConfigError` when `repo_id` (None: not set) is not a Hub repository id `org/name`."""
    if repo_id is not None and not HUB_REPO_ID.fullmatch(repo_id):
        raise ConfigError(
            f"{key}: {repo_id!r} is not a Hugging Face Hub repo id; use org/name (letters, digits, '-', '_', '.')"
        )


def float_settings(config: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Yield `(dotted.key, value)` for every float in a config of nested dataclasses (mapping values too)."""
    for spec in dataclasses.fields(config):
        key = f"{prefix}{spec.name}"
        value = getattr(config, spec.name)
        if dataclasses.is_dataclass(value):
            yield from float_settings(value, f"{key}.")
        elif isinstance(value, dict):
            yield from ((f"{key}.{name}", item) for name, item in value.items() if isinstance(item, float))
        elif isinstance(value, float):
            yield key, value


def _within(spec: str | None, value: float) -> bool:
    if not math.isfinite(value):
        return False
    if spec is None:
        return True
    if spec[0] in "[(":
        low, high = (float(bound) for bound in spec[1:-1].split(","))
        above = value >= low if spec[0] == "[" else value > low
        return above and (value <= high if spec[-1] == "]" else value < high)
    operator, bound = spec.split()
    return value > float(bound) if operator == ">" else value >= float(bound)


def check_floats(config: Any, ranges: dict[str, str]) -> None:
    """Raise `ConfigError` for the first float that is not finite or falls outside its range in `ranges`."""
    for key, value in float_settings(config):
        spec = ranges.get(key)
        if not _within(spec, value):
            accepted = (
                "a finite number" if spec is None else f"in {spec}" if spec[0] in "[(" else f"a finite number {spec}"
            )
            raise ConfigError(f"{key} must be {accepted}, got {value!r}")


def check_counts(values: dict[str, int | None], minimum: int) -> None:
    """Raise `ConfigError` for the first `dotted.key` whose integer is below `minimum` (None means unset and passes)."""
    for key, value in values.items():
        if value is not None and value < minimum:
            raise ConfigError(f"{key} must be at least {minimum}, got {value}")


def check_output_dir(key: str, directory: str) -> None:
    """Raise `ConfigError` when `directory`, or a folder it would be made in, is an existing file."""
    path = Path(directory).expanduser()
    # mkdir would fail only after the model has loaded, and on a file it names a file inside it.
    for candidate in (path, *path.parents):
        if candidate.exists():
            if candidate.is_dir():
                return
            if candidate == path:
                raise ConfigError(
                    f"{key}: {directory} is a file, not a directory; name a directory (it is made if missing)"
                )
            raise ConfigError(
                f"{key}: {directory} cannot be made, {candidate} is a file; name a directory (it is made if missing)"
            )


# output.report_to: every tracker polo reports to (polo.runtime.trackers has a sink for each), and
# the packages it needs beyond polo's own, which the polo extra of the same name installs.
TRACKER_PACKAGES: dict[str, tuple[str, ...]] = {
    "tensorboard": (),
    "jsonl": (),
    "wandb": ("wandb",),
    "trackio": ("trackio",),
    "mlflow": ("mlflow", "pandas"),
}
MLFLOW_LOCAL_STORE = ("sqlalchemy", "alembic")  # mlflow's sqlite store in the output directory (no MLFLOW_TRACKING_URI)


def check_trackers(report_to: list[str]) -> None:
    """Raise `ConfigError` for a tracker polo does not know, or one whose package is not installed (one line, naming the extra)."""
    for name in report_to:
        if name not in TRACKER_PACKAGES:
            raise ConfigError(f"output.report_to: {name!r} is not one of {', '.join(TRACKER_PACKAGES)}")
    for name in dict.fromkeys(report_to):
        needed = TRACKER_PACKAGES[name] + (
            MLFLOW_LOCAL_STORE if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") else ()
        )
        for package in needed:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(
                    f"output.report_to includes {name} but the {package} package is not installed: pip install 'polo[{name}]'"
                )


def check_lora(lora: LoraSettings) -> None:
    """Raise `ConfigError` for LoRA settings that make no sense."""
    if lora.r < 0:
        raise ConfigError(f"model.lora.r must be >= 0 (0 = full fine-tuning), got {lora.r}")
    if lora.r and lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if lora.r and not lora.target_modules:
        raise ConfigError(
            "model.lora.target_modules is empty; name modules (e.g. [q_proj, v_proj]) or use [all-linear]"
        )


def check_device(key: str, device: str) -> None:
    """Raise `ConfigError` when `device` is not auto | cpu | cuda | cuda:N (whether it can be had is asked at set-up)."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", str(device).strip().lower()):
        raise ConfigError(f"{key}: {device!r} is not one of auto, cpu, cuda, cuda:N (auto: CUDA when available)")


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


def check_sizes(config: Config) -> None:
    """Raise `ConfigError` for the first count or size out of its range."""
    check_at_least_one(
        {
            "algorithm.group_size": config.algorithm.group_size,
            "algorithm.update_epochs": config.algorithm.update_epochs,
            "algorithm.max_sampling_rounds": config.algorithm.max_sampling_rounds,
            "train.prompts_per_step": config.train.prompts_per_step,
            "train.num_minibatches": config.train.num_minibatches,
            "train.micro_batch_size": config.train.micro_batch_size,
            "train.max_nonfinite_steps": config.train.max_nonfinite_steps,
            "sampling.max_new_tokens": config.sampling.max_new_tokens,
            "sampling.max_turns": config.sampling.max_turns,
            "sampling.max_episode_tokens": config.sampling.max_episode_tokens,
            "task.environment.memory_mb": config.task.environment.memory_mb,
            "task.environment.max_output_chars": config.task.environment.max_output_chars,
            "eval.batch_size": config.eval.batch_size,
            "output.keep_checkpoints": config.output.keep_checkpoints,
        }
    )
    check_counts({"train.threads": config.train.threads, "eval.max_new_tokens": config.eval.max_new_tokens}, 1)
    check_counts(
        {
            "train.steps": config.train.steps,
            "train.warmup_steps": config.train.warmup_steps,
            "algorithm.critic_warmup_steps": config.algorithm.critic_warmup_steps,
            "task.num_train": config.task.num_train,
            "task.num_eval": config.task.num_eval,
            "eval.every": config.eval.every,
            "output.save_every": config.output.save_every,
            "train.max_rollbacks": config.train.max_rollbacks,
        },
        0,
    )


def validate(config: Config) -> None:
    """Raise `ConfigError` for values that have the right type but make no sense."""
    check_choices(config, _CHOICES)
    for name, registry in _REGISTERED.items():
        check_registered(f"algorithm.{name}", getattr(config.algorithm, name), registry)
    estimator = core.ADVANTAGE_ESTIMATORS.entry(config.algorithm.advantage_estimator)
    check_sizes(config)
    check_floats(config, _FLOAT_RANGES)
    check_output_dir("output.dir", config.output.dir)
    check_device("train.device", config.train.device)
    check_trackers(config.output.report_to)
    check_hub_repo("output.push_to_hub", config.output.push_to_hub)
    check_lora(config.model.lora)
    if config.model.lora.r and estimator.needs_critic:
        raise ConfigError(
            f"model.lora.r > 0 is not supported with PPO's critic (advantage_estimator {config.algorithm.advantage_estimator}) yet; "
            "use full fine-tuning (model.lora.r=0)"
        )
    if config.model.lora.r and config.train.data_parallel == "fsdp":
        raise ConfigError(
            "model.lora.r > 0 is not supported with train.data_parallel=fsdp (the adapters are small: use ddp)"
        )
    if (
        config.algorithm.group_size < 2
        and config.algorithm.scale_rewards
        and config.algorithm.advantage_estimator == "grpo"
    ):
        raise ConfigError("algorithm.group_size must be at least 2 for group-relative advantages")
    if config.train.prompts_per_step % config.train.num_minibatches:
        raise ConfigError(
            f"train.prompts_per_step ({config.train.prompts_per_step}) must be divisible by "
            f"train.num_minibatches ({config.train.num_minibatches}) so groups are never split"
        )
    if config.algorithm.advantage_estimator == "rloo" and config.algorithm.group_size < 2:
        raise ConfigError("algorithm.group_size must be at least 2 for the RLOO leave-one-out baseline")
    if config.algorithm.kl_in_reward and not estimator.token_level:
        token_level = [
            name for name in core.ADVANTAGE_ESTIMATORS.names() if core.ADVANTAGE_ESTIMATORS.entry(name).token_level
        ]
        raise ConfigError(
            f"algorithm.kl_in_reward needs a token-level estimator (advantage_estimator {' or '.join(token_level)})"
        )
    if config.algorithm.kl_in_reward and config.algorithm.beta == 0:
        raise ConfigError("algorithm.kl_in_reward needs algorithm.beta > 0 (the KL coefficient in the reward)")
    if not config.rewards:
        raise ConfigError("rewards: at least one reward function is needed, e.g. {correct: 1.0}")
