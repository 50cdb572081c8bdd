"""Checks on values that have the right type but make no sense (run before anything loads).

`check_settings` checks every field against its own metadata (`polo.config.fields.setting`: the
range of a number, the choices of a string, every float finite), so no table of ranges is kept
here; what stays are the checks a field's metadata cannot state: paths, devices, installed
tracker packages, Hub ids, and the settings that only make sense together.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from polo import core
from polo.config.building import build_dataclass
from polo.config.errors import ConfigError
from polo.config.fields import accepted, choice_names, within
from polo.config.plugins import check_registered, resolve
from polo.config.schema import TRACKER_PACKAGES, Config, LoraSettings, TaskConfig
from polo.core.registry import ENVIRONMENTS, REWARDS, TASKS, Registered, Registry, did_you_mean

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
    if metadata.get("others") is not None:
        pass  # the value may take another form than the choices (a path, an id): checked where it is used
    elif isinstance(value, str) and isinstance(choices, Registry):
        check_registered(key, value, choices)
    elif isinstance(value, str) and choices is not None and value not in choices:
        names = choice_names(choices)
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(names)}{did_you_mean(value, names)}")
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
    check_sampler_correction(config)
    if config.algorithm.kl_in_reward and not estimator.token_level:
        token_level = [
            name for name in core.ADVANTAGE_ESTIMATORS.names() if core.ADVANTAGE_ESTIMATORS.entry(name).token_level
        ]
        raise ConfigError(
            f"algorithm.kl_in_reward needs a token-level estimator (advantage_estimator {' or '.join(token_level)})"
        )
    if config.algorithm.kl_in_reward and config.algorithm.beta == 0:
        raise ConfigError("algorithm.kl_in_reward needs algorithm.beta > 0 (the KL coefficient in the reward)")
    check_reference_motion(config)
    if not config.rewards:
        raise ConfigError("rewards: at least one reward function is needed, e.g. {correct: 1.0}")
    check_rewards(config.rewards)
    task_arguments(config.task)
    environment = config.task.environment
    if environment.name is not None:
        entry = resolve("task.environment.name", environment.name, ENVIRONMENTS)
        option_keywords("task.environment.options", entry, environment.options, positional=1)
    bind_options(
        "algorithm.policy_loss_options",
        core.POLICY_LOSSES.entry(config.algorithm.policy_loss),
        config.algorithm.policy_loss_options,
        positional=2,
    )


def check_reference_motion(config: Config) -> None:
    """Refuse an adaptive KL coefficient or a reference update without the reference they move."""
    alg = config.algorithm
    if alg.kl_target is not None and alg.beta == 0:
        raise ConfigError(
            "algorithm.kl_target needs algorithm.beta > 0 (the adaptive controller's starting coefficient)"
        )
    if alg.sync_ref_model and alg.beta == 0:
        raise ConfigError("algorithm.sync_ref_model needs algorithm.beta > 0 (with no KL term there is no reference)")
    if alg.sync_ref_model and config.model.lora.r:
        raise ConfigError(
            "algorithm.sync_ref_model needs a reference of its own; with model.lora.r > 0 the reference is the "
            "base model under the adapters, which the policy shares (set model.lora.r=0)"
        )
    if alg.sync_ref_model and config.train.data_parallel == "fsdp":
        raise ConfigError("algorithm.sync_ref_model is not supported with train.data_parallel=fsdp; use ddp")


def check_sampler_correction(config: Config) -> None:
    """Raise `ConfigError` for a sampler correction whose bounds are crossed or that this run cannot apply."""
    algorithm = config.algorithm
    if algorithm.sampler_correction is None:
        return
    low, high = algorithm.sampler_correction_min, algorithm.sampler_correction_max
    if low is not None and high is not None and not low < high:
        raise ConfigError(
            f"algorithm.sampler_correction_min ({low}) must be below algorithm.sampler_correction_max ({high})"
        )
    if config.task.environment.name is not None:
        raise ConfigError(
            "algorithm.sampler_correction needs the sampler's own log-probs, which multi-turn episodes "
            "(task.environment) do not record; leave it null"
        )
    if algorithm.policy_loss == "vespo":
        raise ConfigError(
            "algorithm.sampler_correction does not apply to policy_loss vespo, whose kernel would take the weight "
            "inside it; leave it null"
        )


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


REWARD_MODEL_PREFIX = "model:"  # a reward model's directory, scored by polo.rewards.reward_model


def check_rewards(rewards: Mapping[str, float]) -> None:
    """Raise `ConfigError` for a reward name that is neither registered, nor a module's function, nor model:PATH."""
    for name in rewards:
        if name.startswith(REWARD_MODEL_PREFIX):
            continue  # a directory, checked when the reward model loads
        entry = resolve(f"rewards.{name}", name, REWARDS)
        if not callable(entry.value):
            raise ConfigError(
                f"rewards.{name}: {name!r} is a {type(entry.value).__name__}, not a function (completion, row) -> float"
            )


def bind_options(key: str, entry: Registered, options: Mapping[str, Any], positional: int = 0) -> Callable[..., Any]:
    """Return `entry`'s part with its options bound (`option_keywords`), or raise `ConfigError` naming `key`."""
    keywords = option_keywords(key, entry, options, positional)
    return functools.partial(entry.value, **keywords) if keywords else entry.value


def option_keywords(key: str, entry: Registered, options: Mapping[str, Any], positional: int = 0) -> dict[str, Any]:
    """Return the keyword arguments `entry`'s part takes for `options`, or raise `ConfigError` for one it does not take.

    An entry with a settings dataclass gets it built from `options` (every key, type, range and
    choice checked as a recipe's are) as the keyword `options`; one without takes `options` as
    keyword arguments, which its signature must accept beyond the first `positional` arguments the
    caller passes itself.
    """
    if entry.settings is not None:
        built = build_dataclass(entry.settings, dict(options), key)
        check_settings(built, f"{key}.")
        return {"options": built}
    accepted_names = keyword_parameters(entry.value, positional)
    if accepted_names is not None:
        for name in options:
            if name not in accepted_names:
                raise ConfigError(
                    f"{key}.{name}: {entry.name} takes no option {name!r}{did_you_mean(name, accepted_names)}; "
                    f"its options: {', '.join(accepted_names) or 'none'}"
                )
    return dict(options)


def keyword_parameters(function: Callable[..., Any], positional: int = 0) -> list[str] | None:
    """Return the parameters `function` takes by keyword after its first `positional` ones (None: any keyword)."""
    parameters = signature_parameters(function)
    if parameters is None or any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, parameter in list(parameters.items())[positional:] if parameter.kind in keyword]


def task_arguments(task: TaskConfig, passed: Mapping[str, Any] | None = None) -> tuple[Registered, dict[str, Any]]:
    """Return the task `task.name` names and the keyword arguments its builder gets, or raise `ConfigError`.

    A parameter named like a `task` key takes that key's value when it is set (not null), or what
    was `passed` under that name (datasets from Python); a parameter whose default is a dataclass is
    that dataclass with its fields filled the same way (the hf task's source); `task.options` come
    last (`bind_options`). A parameter without a default that nothing fills is a key the task needs.
    """
    entry = resolve("task.name", task.name, TASKS)
    own_keys = ("name", "options", "environment")  # the task's name, its options and its episodes are not rows' keys
    values = {spec.name: getattr(task, spec.name) for spec in dataclasses.fields(task) if spec.name not in own_keys}
    values = {name: value for name, value in {**values, **(passed or {})}.items() if value is not None}
    arguments: dict[str, Any] = {}
    missing = []
    for name, parameter in (signature_parameters(entry.value) or {}).items():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name in values:
            arguments[name] = values[name]
        elif dataclasses.is_dataclass(parameter.default) and not isinstance(parameter.default, type):
            own = {spec.name for spec in dataclasses.fields(parameter.default)}
            arguments[name] = dataclasses.replace(parameter.default, **{k: v for k, v in values.items() if k in own})
        elif parameter.default is inspect.Parameter.empty and name not in task.options and name != "options":
            missing.append(f"task.{name}" if hasattr(task, name) else f"task.options.{name}")
    if missing:
        raise ConfigError(f"task.name={task.name} needs {' and '.join(missing)}, which the recipe leaves unset")
    return entry, {**arguments, **option_keywords("task.options", entry, task.options)}


def signature_parameters(function: Callable[..., Any]) -> dict[str, inspect.Parameter] | None:
    """Return the parameters of `function` (a class: of its constructor) by name; None for one without a signature."""
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
