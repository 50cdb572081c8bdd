"""Checks on values that have the right type but make no sense (run before anything loads).

`check_settings` checks every field against its own metadata (`polo.config.fields.setting`: the
range of a number, the choices of a string, every float finite), so no table of ranges is kept
here; what stays are the checks a field's metadata cannot state: paths, devices, installed
tracker packages, Hub ids, and the settings that only make sense together.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from polo import core
from polo.config.errors import ConfigError
from polo.config.fields import accepted, choice_names, within
from polo.config.plugins import check_registered
from polo.config.schema import TRACKER_PACKAGES, Config, LoraSettings
from polo.core.registry import Registry

# A Hugging Face Hub repository id, namespace/name: each part 1-96 letters, digits, '_', '-' or '.',
# starting and ending with a letter, digit or '_', with no '--' or '..' (huggingface_hub's rule).
HUB_REPO_ID = re.compile(r"(?!.*(?:--|\.\.))(?=[^/]{1,96}/[^/]{1,96}$)\w(?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?", re.ASCII)
MLFLOW_LOCAL_STORE = ("sqlalchemy", "alembic")  # mlflow's sqlite store in the output directory (no MLFLOW_TRACKING_URI)


def check_settings(config: Any, prefix: str = "") -> None:
    """Raise `ConfigError` for the first field of a config (nested dataclasses too) outside its range or choices.

    Every float must be finite (a NaN or inf passes every comparison silently or fails deep inside
    a step, so it is never a meaningful setting), the floats of a mapping (`rewards`) too. None is
    an unset optional field and passes.
    """
    for spec in dataclasses.fields(config):
        key, value = f"{prefix}{spec.name}", getattr(config, spec.name)
        if dataclasses.is_dataclass(value):
            check_settings(value, f"{key}.")
        elif isinstance(value, dict):
            for name, item in value.items():
                check_value(f"{key}.{name}", item, {})
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_settings(item, f"{key}[{index}].")
                else:
                    check_value(key if isinstance(item, str) else f"{key}[{index}]", item, spec.metadata)
        else:
            check_value(key, value, spec.metadata)


def check_value(key: str, value: Any, metadata: Any) -> None:
    """Raise `ConfigError` when one value is outside the range or choices its field's metadata names."""
    choices, bounds = metadata.get("choices"), metadata.get("range")
    if isinstance(value, str) and isinstance(choices, Registry):
        check_registered(key, value, choices)
    elif isinstance(value, str) and choices is not None and value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choice_names(choices))}")
    elif isinstance(value, float) and not within(bounds, value):
        raise ConfigError(f"{key} must be {accepted(bounds)}, got {value!r}")
    elif isinstance(value, int) and not isinstance(value, bool) and bounds is not None and not within(bounds, value):
        raise ConfigError(f"{key} must be {accepted(bounds, integer=True)}, got {value}")


def check_hub_repo(key: str, repo_id: str | None) -> None:
    """Raise `ConfigError` when `repo_id` (None: not set) is not a Hub repository id `org/name`."""
    if repo_id is not None and not HUB_REPO_ID.fullmatch(repo_id):
        raise ConfigError(
            f"{key}: {repo_id!r} is not a Hugging Face Hub repo id; use org/name (letters, digits, '-', '_', '.')"
        )


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


def check_trackers(report_to: list[str], key: str = "output.report_to") -> None:
    """Raise `ConfigError` for a tracker whose package is not installed (one line, naming the extra)."""
    for name in dict.fromkeys(report_to):
        needed = TRACKER_PACKAGES[name] + (
            MLFLOW_LOCAL_STORE if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") else ()
        )
        for package in needed:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(
                    f"{key} includes {name} but the {package} package is not installed: pip install 'polo[{name}]'"
                )


def check_output(output: Any, key: str = "output") -> None:
    """Raise `ConfigError` for an output section whose directory, trackers or Hub repo cannot be had."""
    check_output_dir(f"{key}.dir", output.dir)
    if output.tracker_dir is not None:
        check_output_dir(f"{key}.tracker_dir", output.tracker_dir)
    check_trackers(output.report_to, f"{key}.report_to")
    check_hub_repo(f"{key}.push_to_hub", getattr(output, "push_to_hub", None))


def check_lora(lora: LoraSettings) -> None:
    """Raise `ConfigError` for LoRA settings that make no sense together."""
    if lora.r and lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}")
    if lora.r and not lora.target_modules:
        raise ConfigError(
            "model.lora.target_modules is empty; name modules (e.g. [q_proj, v_proj]) or use [all-linear]"
        )


def check_device(key: str, device: str) -> None:
    """Raise `ConfigError` when `device` is not auto | cpu | cuda | cuda:N (set-up asks whether it can be had)."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", str(device).strip().lower()):
        raise ConfigError(f"{key}: {device!r} is not one of auto, cpu, cuda, cuda:N (auto: CUDA when available)")


def validate(config: Config) -> None:
    """Raise `ConfigError` for values that have the right type but make no sense."""
    check_settings(config)
    estimator = core.ADVANTAGE_ESTIMATORS.entry(config.algorithm.advantage_estimator)
    check_output(config.output)
    check_device("train.device", config.train.device)
    check_lora(config.model.lora)
    if config.model.lora.r and estimator.needs_critic:
        raise ConfigError(
            "model.lora.r > 0 is not supported with PPO's critic "
            f"(advantage_estimator {config.algorithm.advantage_estimator}) yet; use full fine-tuning (model.lora.r=0)"
        )
    if config.model.lora.r and config.train.data_parallel == "fsdp":
        raise ConfigError(
            "model.lora.r > 0 is not supported with train.data_parallel=fsdp (the adapters are small: use ddp)"
        )
    check_groups(config)
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


def check_groups(config: Config) -> None:
    """Raise `ConfigError` when groups could not be formed or would be split across minibatches."""
    algorithm = config.algorithm
    if algorithm.group_size < 2 and algorithm.scale_rewards and algorithm.advantage_estimator == "grpo":
        raise ConfigError("algorithm.group_size must be at least 2 for group-relative advantages")
    if config.train.prompts_per_step % config.train.num_minibatches:
        raise ConfigError(
            f"train.prompts_per_step ({config.train.prompts_per_step}) must be divisible by "
            f"train.num_minibatches ({config.train.num_minibatches}) so groups are never split"
        )
    if algorithm.advantage_estimator == "rloo" and algorithm.group_size < 2:
        raise ConfigError("algorithm.group_size must be at least 2 for the RLOO leave-one-out baseline")
