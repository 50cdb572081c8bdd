"""Run configuration: typed dataclasses, YAML recipes and `dotted.key=value` overrides.

A recipe is a YAML mapping whose sections mirror the dataclasses below. Every key is checked:
an unknown key or a value of the wrong type is a `ConfigError` naming the key and what is
accepted, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml


class ConfigError(ValueError):
    """A recipe or override that does not fit the configuration schema."""


@dataclass
class LoraSettings:
    """Low-rank adapters (peft's LoRA) instead of full fine-tuning; `r: 0` trains every weight."""

    r: int = 0  # adapter rank; 0 = full fine-tuning (the default)
    alpha: float = 32.0  # the adapter's update is scaled by alpha / r
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # module names, or all-linear (every linear layer but the LM head)


@dataclass
class ModelConfig:
    """Which causal LM to train."""

    name: str = "smollm2-135m-instruct"  # a built-in model name or a local HF model directory
    attn_implementation: str | None = None  # eager | sdpa | None (transformers' default: sdpa)
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class TaskConfig:
    """Which prompts to train and evaluate on, and how they are phrased."""

    name: str = "arithmetic"  # arithmetic | gsm8k | jsonl
    instruction: str | None = None  # template with {question}; None picks the task's default
    system_prompt: str | None = None
    answer_in_tags: bool = False  # the answer only counts inside <answer>...</answer>
    num_train: int | None = None
    num_eval: int | None = 200
    # arithmetic
    seed: int = 0
    operators: list[str] = field(default_factory=lambda: ["+"])
    min_digits: int = 2
    max_digits: int = 2
    # gsm8k / jsonl
    train_path: str | None = None
    eval_path: str | None = None
    prompt_field: str = "question"
    answer_field: str = "answer"
    checker: str = "math_verify"  # jsonl only: math_verify | exact_number | exact_string


@dataclass
class SamplingConfig:
    """How completions are sampled during training."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64


@dataclass
class AlgorithmConfig:
    """The policy-optimization estimator and loss. `name` picks a preset (see `PRESETS`); any field set
    in the recipe or on the command line wins over the preset's value."""

    name: str = "grpo"  # grpo | dr_grpo | dapo | rloo | reinforce_pp | gspo | ppo
    advantage_estimator: str = "grpo"  # grpo | rloo | reinforce_pp | gae
    policy_loss: str = "ppo_clip"  # ppo_clip (token ratio) | gspo (sequence ratio)
    group_size: int = 8  # G completions per prompt
    scale_rewards: bool = True  # divide group-centred rewards by the group std
    advantage_eps: float = 1e-4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    beta: float = 0.0  # KL coefficient; a reference model is kept only when beta > 0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False  # fold -beta*KL into per-token rewards (REINFORCE++, PPO) instead of the loss
    loss_aggregation: str = "grpo"  # grpo | bnpo | dapo | dr_grpo
    update_epochs: int = 1  # mu: passes over each batch; old log-probs are computed when > 1
    # DAPO
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, sample more prompts to refill
    max_sampling_rounds: int = 3  # cap on sampling rounds per step under dynamic sampling
    overlong_buffer: float = 0.0  # soft overlong penalty over the last fraction of max_new_tokens (DAPO: 0.2); 0 = off
    overlong_penalty: float = 1.0  # the penalty reached at max_new_tokens
    mask_truncated: bool = False  # leave completions cut by max_new_tokens out of the loss
    # returns and the critic (REINFORCE++, PPO)
    gamma: float = 1.0
    lam: float = 0.95  # GAE lambda
    critic: str = "separate"  # separate (own trunk) | head (value head on the policy trunk)
    critic_learning_rate: float = 1e-5
    critic_warmup_steps: int = 0  # steps that train only the critic before the policy moves
    value_clip: float | None = 0.2
    value_coef: float = 0.5  # weight of the value loss (matters when the trunk is shared)


# Each algorithm is a set of AlgorithmConfig values over the one loop. References: GRPO (Shao et al.
# 2024, DeepSeekMath); Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"); DAPO
# (Yu et al. 2025: eps_high 0.28, dynamic sampling, token-level loss, soft overlong punishment with
# a 4096-token buffer under a 20480 cap = 0.2); RLOO (Ahmadian et al. 2024); REINFORCE++ (Hu 2025:
# KL in the reward, batch-normalised returns); GSPO (Zheng et al. 2025: clip range 3e-4 / 4e-4);
# PPO for LMs (Ouyang et al. 2022; Stiennon et al. 2020).
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dr_grpo": {"scale_rewards": False, "loss_aggregation": "dr_grpo"},
    "dapo": {
        "clip_eps_low": 0.2, "clip_eps_high": 0.28, "dynamic_sampling": True, "loss_aggregation": "dapo",
        "overlong_buffer": 0.2, "beta": 0.0,
    },
    "rloo": {"advantage_estimator": "rloo"},
    "reinforce_pp": {
        "advantage_estimator": "reinforce_pp", "kl_in_reward": True, "beta": 0.01, "kl_estimator": "k1",
        "loss_aggregation": "dapo",
    },
    "gspo": {"policy_loss": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
    "ppo": {
        "advantage_estimator": "gae", "kl_in_reward": True, "beta": 0.05, "kl_estimator": "k1",
        "loss_aggregation": "dapo", "gamma": 1.0, "lam": 0.95,
    },
}


def apply_preset(data: dict) -> dict:
    """Return recipe data whose `algorithm` section is the named preset under the recipe's own keys."""
    algorithm = data.get("algorithm") or {}
    if not isinstance(algorithm, dict):
        raise ConfigError(f"algorithm: expected a mapping of AlgorithmConfig fields, got {algorithm!r}")
    name = algorithm.get("name", "grpo")
    if name not in PRESETS:
        raise ConfigError(f"algorithm.name: {name!r} is not one of {', '.join(PRESETS)}")
    return {**data, "algorithm": {**PRESETS[name], **algorithm, "name": name}}


@dataclass
class TrainConfig:
    """Batch shape, optimizer and schedule."""

    steps: int = 50
    prompts_per_step: int = 8  # P prompts, each sampled group_size times
    num_minibatches: int = 1  # optimizer steps per pass over the batch
    micro_batch_size: int = 32  # sequences per forward/backward (gradient accumulation)
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine (after warm-up)
    max_grad_norm: float = 1.0
    seed: int = 0
    precision: str = "auto"  # auto | fp32 | bf16 (autocast) | bf16_master (bf16 weights, fp32 masters); see polo.lm.precision
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # Recompute activations in backward: with micro-batches of 32 as fast as 16 without it, at 60% of the memory.
    gradient_checkpointing: bool = True
    on_reward_error: str = "raise"  # raise: stop naming the function and sample | zero: score 0, count, go on
    max_nonfinite_steps: int = 3  # a NaN/inf loss skips its step; this many in a row stop the run
    # Under torchrun: ddp (every rank holds the whole model) | fsdp (parameters, gradients and Adam
    # state sharded across ranks; weights gathered whole for generation). Ignored in one process.
    data_parallel: str = "ddp"


@dataclass
class EvalConfig:
    """Greedy held-out evaluation."""

    before: bool = True  # evaluate the starting model
    after: bool = True
    every: int = 0  # also every N steps (0: never)
    max_new_tokens: int | None = None  # None: sampling.max_new_tokens
    batch_size: int = 64


@dataclass
class OutputConfig:
    """Where a run writes, how often it checkpoints, and resuming."""

    dir: str = "runs/grpo"
    save_every: int = 10  # 0 disables periodic checkpoints
    keep_checkpoints: int = 2
    resume: bool = False
    tensorboard: bool = True
    plots: bool = True
    progress: bool = True


@dataclass
class Config:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rewards: dict[str, float] = field(default_factory=lambda: {"correct": 1.0})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Return `value` checked (and, where lossless, converted) against a type annotation."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as error:
                errors.append(error)
        raise ConfigError(f"{key}: {value!r} is not a {_type_name(annotation)}")
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return _build(annotation, value, key)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(item, item_type, f"{key}[{index}]") for index, item in enumerate(value)]
    if origin is dict:
        key_type, item_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {str(k): _coerce(v, item_type, f"{key}.{k}") for k, v in value.items()}
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "1e-6" as a string
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {_type_name(annotation)}")


def _build(cls: type, values: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in hints:
            raise ConfigError(f"unknown config key {key!r}; valid keys{' in ' + prefix if prefix else ''}: {', '.join(valid)}")
        kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def config_to_dict(config: Config) -> dict:
    """Return the configuration as plain nested dicts (for YAML, JSON and TensorBoard)."""
    return dataclasses.asdict(config)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return `data` with each `dotted.key=value` override set (values parsed as YAML scalars)."""
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} is not of the form dotted.key=value")
        dotted, raw = override.split("=", 1)
        parts = dotted.strip().split(".")
        if parts[0] == "rewards" and len(parts) > 2:
            # reward names may be import paths with dots: rewards.my_pkg.scoring:fn=0.5
            parts = ["rewards", ".".join(parts[1:])]
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return data


def read_recipe(recipe: str | Path | dict | None, overrides: list[str] | None = None) -> dict:
    """Return a recipe (YAML path, mapping or None) as a plain dict with the overrides applied."""
    if recipe is None:
        data: dict = {}
    elif isinstance(recipe, dict):
        data = dict(recipe)
    else:
        path = Path(recipe)
        if not path.exists():
            raise FileNotFoundError(f"recipe {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"recipe {path} is not valid YAML: {error}") from error
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return apply_overrides(data, overrides or [])


def build_dataclass(cls: type, data: dict) -> Any:
    """Return an instance of the dataclass `cls` built from nested dicts, every key and type checked."""
    return _build(cls, data)


def load_config(recipe: str | Path | dict | None = None, overrides: list[str] | None = None) -> Config:
    """Return a validated `Config` from a recipe (path or mapping) plus dotted overrides."""
    config = _build(Config, apply_preset(read_recipe(recipe, overrides)))
    validate(config)
    return config


_CHOICES = {
    "train.precision": ("auto", "fp32", "bf16", "bf16_master"),
    "train.lr_schedule": ("constant", "linear", "cosine"),
    "train.on_reward_error": ("raise", "zero"),
    "train.data_parallel": ("ddp", "fsdp"),
    "algorithm.loss_aggregation": ("grpo", "bnpo", "dapo", "dr_grpo"),
    "algorithm.kl_estimator": ("k1", "k2", "k3"),
    "algorithm.name": tuple(PRESETS),
    "algorithm.advantage_estimator": ("grpo", "rloo", "reinforce_pp", "gae"),
    "algorithm.policy_loss": ("ppo_clip", "gspo"),
    "algorithm.critic": ("separate", "head"),
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
    if config.model.lora.r and config.algorithm.advantage_estimator == "gae":
        raise ConfigError("model.lora.r > 0 is not supported with PPO's critic (advantage_estimator gae) yet; use full fine-tuning (model.lora.r=0)")
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
    if config.algorithm.kl_in_reward and config.algorithm.advantage_estimator not in ("reinforce_pp", "gae"):
        raise ConfigError("algorithm.kl_in_reward needs a token-level estimator (advantage_estimator reinforce_pp or gae)")
    if config.algorithm.kl_in_reward and config.algorithm.beta == 0:
        raise ConfigError("algorithm.kl_in_reward needs algorithm.beta > 0 (the KL coefficient in the reward)")
    if not config.rewards:
        raise ConfigError("rewards: at least one reward function is needed, e.g. {correct: 1.0}")
