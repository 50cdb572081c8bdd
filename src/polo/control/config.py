"""Configuration of a classic-control run: typed dataclasses read from a YAML recipe.

A recipe has the sections `env`, `policy`, `algorithm`, `train` and `output`; every key is
checked by `polo.config.build_dataclass`, so a typo is an error that names the valid keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from polo.config import ConfigError, build_dataclass, check_at_least_one, check_choices, read_recipe
from polo.config.validation import check_floats, check_output_dir


@dataclass
class EnvConfig:
    """Which Gymnasium environment, and how many copies step together."""

    id: str = "CartPole-v1"
    num_envs: int = 8
    # auto: Gymnasium's numpy-vectorised entry point where the environment has one (CartPole),
    # else one Python env per copy (sync). Grouped episodes (GRPO) always use sync, since each
    # copy must be reset from its own seed.
    vectorization: str = "auto"  # auto | vector | sync
    reward_scale: float = 1.0  # rewards are multiplied by this before any return is computed


@dataclass
class PolicyConfig:
    """The actor (and critic) networks."""

    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    activation: str = "tanh"  # tanh | relu
    orthogonal_init: bool = True
    log_std_init: float = 0.0  # Gaussian policies: initial log standard deviation


@dataclass
class AlgorithmConfig:
    """The estimator and update; which fields matter depends on `name`."""

    name: str = "ppo"  # reinforce | a2c | trpo | ppo | grpo
    gamma: float = 0.99
    gae_lambda: float = 0.95  # ppo, trpo; a2c uses 1 (n-step returns)
    normalize_advantages: bool = True
    # reinforce
    baseline: bool = True  # learn V(s) and use G_t − V(s_t); false: plain reward-to-go
    # ppo and grpo
    clip_range: float = 0.2
    clip_schedule: str = "constant"  # constant | linear (to 0 over train.total_steps)
    clip_range_value: float | None = None  # ppo: clip V around the old value; None: unclipped
    target_kl: float | None = None  # ppo: stop the epoch loop once approx-KL exceeds 1.5x this
    # losses
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    # trpo
    max_kl: float = 0.01  # δ, the trust-region radius
    cg_iterations: int = 10
    cg_damping: float = 0.1
    line_search_steps: int = 10
    line_search_shrink: float = 0.5
    # grpo
    group_size: int = 8  # G episodes from one reset seed
    scale_by_std: bool = True  # divide group-centred returns by the group std (false: Dr. GRPO)


@dataclass
class TrainConfig:
    """How much experience per update, how it is reused, the optimizer and the budget."""

    total_steps: int = 100_000  # environment steps (transitions) in all
    rollout_steps: int = 128  # per env and update, for n-step algorithms (a2c, trpo, ppo)
    episodes_per_update: int = 16  # reinforce and grpo: whole episodes per update (grpo: groups x group_size)
    epochs: int = 10  # passes over each batch (ppo, grpo; trpo's critic; reinforce's baseline)
    minibatch_size: int = 64  # transitions per gradient step; 0: the whole batch
    learning_rate: float = 3e-4
    value_learning_rate: float | None = None  # separate critic rate (trpo, reinforce); None: learning_rate
    lr_schedule: str = "constant"  # constant | linear (to 0 over total_steps)
    optimizer: str = "adam"  # adam | rmsprop
    adam_eps: float = 1e-5
    max_grad_norm: float | None = 0.5
    clip_grad_norm_per_network: bool = False  # ppo: clip the actor's and the critic's gradients separately
    seed: int = 0
    threads: int = 1  # torch intra-op threads: tiny networks are fastest on one
    target_return: float | None = None  # "solved" once the mean of the last 20 episodes reaches it
    stop_at_target: bool = False  # end the run as soon as it is solved
    solve_window: int = 20  # episodes in the moving mean that decides "solved"


@dataclass
class OutputConfig:
    """Where a run writes."""

    dir: str = "runs/control"
    overwrite: bool = False  # replace an earlier run's files in dir (else a run there is refused)
    tensorboard: bool = True
    plots: bool = True
    progress: bool = True
    log_every: int = 1  # write a metrics row every N updates


@dataclass
class ControlConfig:
    """A whole classic-control run."""

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


ALGORITHMS = ("reinforce", "a2c", "trpo", "ppo", "grpo")

_CHOICES = {
    "algorithm.name": ALGORITHMS,
    "algorithm.clip_schedule": ("constant", "linear"),
    "env.vectorization": ("auto", "vector", "sync"),
    "policy.activation": ("tanh", "relu"),
    "train.lr_schedule": ("constant", "linear"),
    "train.optimizer": ("adam", "rmsprop"),
}

# Beyond finite, which every float must be; an optional float left unset (None) is not checked.
_FLOAT_RANGES = {
    "algorithm.gamma": "(0, 1]",
    "algorithm.gae_lambda": "[0, 1]",
    "algorithm.clip_range": "(0, 1)",
    "algorithm.clip_range_value": "> 0",
    "algorithm.target_kl": "> 0",
    "algorithm.value_coef": ">= 0",
    "algorithm.entropy_coef": ">= 0",
    "algorithm.max_kl": "> 0",
    "algorithm.cg_damping": ">= 0",
    "algorithm.line_search_shrink": "(0, 1)",
    "train.learning_rate": "> 0",
    "train.value_learning_rate": "> 0",
    "train.adam_eps": "> 0",
    "train.max_grad_norm": "> 0",
}


def config_to_dict(config: ControlConfig) -> dict:
    """Return the configuration as plain nested dicts."""
    return dataclasses.asdict(config)


def load_control_config(recipe: str | Path | dict | None = None, overrides: list[str] | None = None) -> ControlConfig:
    """Return a validated `ControlConfig` from a recipe (path or mapping) plus dotted overrides."""
    config = build_dataclass(ControlConfig, read_recipe(recipe, overrides))
    validate(config)
    return config


def validate(config: ControlConfig) -> None:
    """Raise `ConfigError` for values that have the right type but make no sense."""
    check_choices(config, _CHOICES)
    check_at_least_one(
        {
            "env.num_envs": config.env.num_envs,
            "train.total_steps": config.train.total_steps,
            "train.rollout_steps": config.train.rollout_steps,
            "train.episodes_per_update": config.train.episodes_per_update,
            "train.epochs": config.train.epochs,
            "train.threads": config.train.threads,
            "train.solve_window": config.train.solve_window,
            "algorithm.cg_iterations": config.algorithm.cg_iterations,
            "algorithm.line_search_steps": config.algorithm.line_search_steps,
            "output.log_every": config.output.log_every,
        }
    )
    if config.train.minibatch_size < 0:
        raise ConfigError(f"train.minibatch_size must be >= 0 (0: whole batch), got {config.train.minibatch_size}")
    check_floats(config, _FLOAT_RANGES)
    check_output_dir("output.dir", config.output.dir)
    if config.algorithm.name == "grpo":
        group_size = config.algorithm.group_size
        if group_size < 2:
            raise ConfigError(f"algorithm.group_size must be at least 2 for a group baseline, got {group_size}")
        if config.train.episodes_per_update % group_size:
            raise ConfigError(
                f"train.episodes_per_update ({config.train.episodes_per_update}) must be a multiple of "
                f"algorithm.group_size ({group_size}) so every group is whole"
            )
