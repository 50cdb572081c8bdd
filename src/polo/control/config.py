"""Configuration of `polo control`: typed dataclasses read from a YAML recipe, every field documented.

A recipe has the sections `env`, `policy`, `algorithm`, `train` and `output`; every key is
checked by `polo.config.build_dataclass`, so a typo is an error that names the valid keys, and
every value against its field's range and choices (`polo.config.check_settings`). The `train`
section is polo's shared `OptimizerConfig` with the budget and batch keys of on-policy control.

The algorithms register themselves in `ALGORITHMS` (`register_algorithm`, next to each class),
so `algorithm.name` accepts exactly the registered ones, and module:name for a user's own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from polo.config import ConfigError, OptimizerConfig, build_dataclass, check_settings, read_recipe, setting
from polo.config.fields import override
from polo.config.schema import (
    CallbackConfig,
    callbacks_setting,
    project_setting,
    report_to_setting,
    run_name_setting,
    threads_setting,
    tracker_dir_setting,
)
from polo.config.validation import check_output
from polo.core.registry import CONTROL_ALGORITHMS, register_control_algorithm

# name -> OnPolicyAlgorithm subclass; filled by `register_algorithm` in a2c.py, grpo.py, ppo.py, reinforce.py, trpo.py.
ALGORITHMS = CONTROL_ALGORITHMS
register_algorithm = register_control_algorithm


@dataclass
class EnvConfig:
    """Which Gymnasium environment, and how many copies step together."""

    id: str = setting("CartPole-v1", help="a Gymnasium environment id (discrete or continuous actions)")
    num_envs: int = setting(8, help="copies stepped together (n-step algorithms)", range=">= 1")
    vectorization: str = setting(
        "auto",
        help="auto: Gymnasium's numpy-vectorised entry point where the environment has one (CartPole), else one "
        "Python env per copy (sync); grouped episodes (grpo) always use sync, each copy reset from its own seed",
        choices=("auto", "vector", "sync"),
    )
    reward_scale: float = setting(1.0, help="rewards are multiplied by this before any return is computed")


@dataclass
class PolicyConfig:
    """The actor (and critic) networks."""

    hidden_sizes: list[int] = setting([64, 64], help="widths of the hidden layers of each network", range=">= 1")
    activation: str = setting("tanh", help="the hidden layers' activation", choices=("tanh", "relu"))
    orthogonal_init: bool = setting(
        True, help="orthogonal weights with per-layer gains, as in the PPO implementation details (Huang et al. 2022)"
    )
    log_std_init: float = setting(0.0, help="Gaussian policies: the initial log standard deviation")


@dataclass
class ControlAlgorithmConfig:
    """The estimator and update; which fields matter depends on `name`."""

    name: str = setting(
        "ppo",
        help="the on-policy algorithm",
        choices=ALGORITHMS,
    )
    gamma: float = setting(0.99, help="γ, the discount", range="(0, 1]")
    gae_lambda: float = setting(
        0.95, help="λ of GAE (Schulman et al. 2016) for ppo and trpo; a2c uses 1 (n-step returns)", range="[0, 1]"
    )
    normalize_advantages: bool = setting(True, help="whiten advantages over the batch before the loss")
    baseline: bool = setting(True, help="reinforce: learn V(s) and use G_t − V(s_t); false: plain reward-to-go")
    clip_range: float = setting(0.2, help="ppo and grpo: ε of the clipped ratio 1 ± ε", range="(0, 1)")
    clip_schedule: str = setting(
        "constant", help="ppo and grpo: constant, or linear to 0 over train.total_steps", choices=("constant", "linear")
    )
    clip_range_value: float | None = setting(
        None, help="ppo: clip V within this of the old value; null: unclipped", range="> 0"
    )
    target_kl: float | None = setting(
        None, help="ppo: stop the epoch loop once the approximate KL exceeds 1.5x this; null: never", range="> 0"
    )
    value_coef: float = setting(0.5, help="weight of the value loss", range=">= 0")
    entropy_coef: float = setting(0.0, help="weight of the entropy bonus", range=">= 0")
    max_kl: float = setting(0.01, help="trpo: δ, the trust region's KL radius", range="> 0")
    cg_iterations: int = setting(10, help="trpo: conjugate-gradient iterations for the natural gradient", range=">= 1")
    cg_damping: float = setting(0.1, help="trpo: damping added to the Fisher-vector product", range=">= 0")
    line_search_steps: int = setting(10, help="trpo: backtracking line-search steps", range=">= 1")
    line_search_shrink: float = setting(
        0.5, help="trpo: each line-search step shrinks the step by this", range="(0, 1)"
    )
    group_size: int = setting(8, help="grpo: G episodes from one reset seed (at least 2)", range=">= 1")
    scale_by_std: bool = setting(
        True, help="grpo: divide group-centred returns by the group's std (false: Dr. GRPO, Liu et al. 2025)"
    )


@dataclass
class ControlTrainConfig(OptimizerConfig):
    """How much experience per update, how it is reused, the optimizer and the budget."""

    learning_rate: float = override(OptimizerConfig, "learning_rate", 3e-4)
    adam_beta2: float = override(
        OptimizerConfig, "adam_beta2", 0.999, help="β2, the decay of Adam's second-moment estimate (torch's default)"
    )
    adam_eps: float = override(
        OptimizerConfig, "adam_eps", 1e-5, help="ε of Adam's (and RMSprop's) denominator (1e-5, as SB3 and CleanRL)"
    )
    warmup_steps: int = override(
        OptimizerConfig, "warmup_steps", 0, help="environment steps of linear warm-up before the schedule"
    )
    lr_schedule: str = override(
        OptimizerConfig,
        "lr_schedule",
        "constant",
        help="the learning rate after warm-up: constant, or linear or cosine decay to 0 at train.total_steps",
    )
    max_grad_norm: float | None = override(
        OptimizerConfig, "max_grad_norm", 0.5, help="clip each update's gradient L2 norm to this; null: no clipping"
    )
    optimizer: str = setting(
        "adam",
        help="adam: polo's AdamW (weight_decay 0 by default, so Adam) | rmsprop (α 0.99, as A2C's paper and SB3)",
        choices=("adam", "rmsprop"),
    )
    total_steps: int = setting(100_000, help="environment steps (transitions) in all", range=">= 1")
    rollout_steps: int = setting(
        128, help="steps per env copy and update, for the n-step algorithms (a2c, trpo, ppo)", range=">= 1"
    )
    episodes_per_update: int = setting(
        16, help="reinforce and grpo: whole episodes per update (grpo: groups x group_size)", range=">= 1"
    )
    epochs: int = setting(
        10, help="passes over each batch (ppo, grpo; trpo's critic; reinforce's baseline)", range=">= 1"
    )
    minibatch_size: int = setting(64, help="transitions per gradient step; 0: the whole batch", range=">= 0")
    value_learning_rate: float | None = setting(
        None, help="the critic's own rate (trpo, reinforce); null: learning_rate", range="(0, 1]"
    )
    clip_grad_norm_per_network: bool = setting(
        False, help="ppo: clip the actor's and the critic's gradients separately"
    )
    seed: int = setting(0, help="seeds the networks, the environments and every random stream")
    threads: int = threads_setting(1)
    target_return: float | None = setting(
        None, help='"solved" once the mean return of the last solve_window episodes reaches it; null: never'
    )
    stop_at_target: bool = setting(False, help="end the run as soon as it is solved")
    solve_window: int = setting(20, help="episodes in the moving mean that decides solved", range=">= 1")


@dataclass
class ControlOutputConfig:
    """Where a control run writes, and its trackers."""

    dir: str = setting("runs/control", help="the run directory: config.yaml, metrics.jsonl, plots")
    overwrite: bool = setting(False, help="replace an earlier run's files in dir (else a run there is refused)")
    report_to: list[str] = report_to_setting()
    project: str | None = project_setting()
    run_name: str | None = run_name_setting()
    tracker_dir: str | None = tracker_dir_setting()
    plots: bool = setting(True, help="draw the return and diagnostics curves at the end")
    progress: bool = setting(True, help="show a progress bar")
    log_every: int = setting(1, help="write a metrics row every N updates", range=">= 1")
    callbacks: list[CallbackConfig] = callbacks_setting()


@dataclass
class ControlConfig:
    """`polo control RECIPE.yaml`: on-policy RL (REINFORCE to PPO and GRPO) on a Gymnasium control task."""

    env: EnvConfig = setting(default_factory=EnvConfig, help="the environment")
    policy: PolicyConfig = setting(default_factory=PolicyConfig, help="the networks")
    algorithm: ControlAlgorithmConfig = setting(default_factory=ControlAlgorithmConfig, help="the algorithm")
    train: ControlTrainConfig = setting(default_factory=ControlTrainConfig, help="optimizer and budget")
    output: ControlOutputConfig = setting(default_factory=ControlOutputConfig, help="where the run writes")


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
    check_settings(config)
    check_output(config.output)
    if config.algorithm.name == "grpo":
        group_size = config.algorithm.group_size
        if group_size < 2:
            raise ConfigError(f"algorithm.group_size must be at least 2 for a group baseline, got {group_size}")
        if config.train.episodes_per_update % group_size:
            raise ConfigError(
                f"train.episodes_per_update ({config.train.episodes_per_update}) must be a multiple of "
                f"algorithm.group_size ({group_size}) so every group is whole"
            )
