"""The one on-policy loop: collect → build the batch → the algorithm's update → log; repeat.

    result = polo.control.train("recipes/ppo_cartpole.yaml", ["train.seed=3"])

Every algorithm runs through `train`; they differ only in the class `ALGORITHMS[name]` (registered by
`polo.control.base.register_algorithm`)
(its `update`, whether it needs a critic, and whether it collects T steps or whole episodes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

# Imported for their @register_algorithm: each adds its class to ALGORITHMS.
from polo.control import a2c, grpo, ppo, reinforce, trpo  # noqa: F401
from polo.control.base import OnPolicyAlgorithm
from polo.control.config import ALGORITHMS, ControlConfig, config_to_dict, load_control_config
from polo.control.envs import action_spec, make_vector_env
from polo.control.policies import ActorCritic
from polo.control.rollout import EpisodeCollector, EpisodeTracker, StepCollector, build_batch
from polo.runtime.checkpoint import claim_output_dir
from polo.runtime.device import torch_threads
from polo.runtime.metrics import MetricsLogger
from polo.runtime.run_lock import owned_run_dir
from polo.runtime.trackers import Trackers


@dataclass
class ControlResult:
    """What a run did: steps taken, when (if ever) it was solved, and every episode's return."""

    env_steps: int
    updates: int
    seconds: float
    solved_at_step: int | None
    solved_at_seconds: float | None
    episode_returns: list[float] = field(default_factory=list)
    episode_end_steps: list[int] = field(default_factory=list)  # env steps when each episode ended
    output_dir: Path | None = None
    policy: ActorCritic | None = None

    def last_mean(self, window: int = 20) -> float | None:
        """Return the mean return of the last `window` episodes (None without episodes)."""
        recent = self.episode_returns[-window:]
        return sum(recent) / len(recent) if recent else None


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def train(
    config: ControlConfig | str | Path | dict | None = None,
    overrides: list[str] | None = None,
    *,
    write_files: bool = True,
) -> ControlResult:
    """Run one classic-control training run and return its `ControlResult`.

    `config` is a `ControlConfig`, or a recipe (YAML path or mapping) to which `overrides`
    (`dotted.key=value`) are applied. With `write_files=False` nothing is written to disk
    (no metrics, plots or TensorBoard): for benchmarks and tests. A run that writes holds its
    `output.dir` against a second run from the start (`polo.runtime.run_lock`).
    """
    config = _resolve_config(config, overrides)
    with torch_threads(config.train.threads):
        if not write_files:
            return _run(config, write_files)
        with owned_run_dir(config.output.dir):
            return _run(config, write_files)


def _run(config: ControlConfig, write_files: bool) -> ControlResult:
    """Return the `ControlResult` of one run of a loaded config (the caller holds its output.dir when it writes)."""
    started = time.perf_counter()  # "seconds to solve" include building the envs and networks
    train_config, output = config.train, config.output
    _seed_everything(train_config.seed)
    algorithm_class = ALGORITHMS[config.algorithm.name]
    episodes = algorithm_class.collects == "episodes"
    grouped = config.algorithm.name == "grpo"
    num_envs = train_config.episodes_per_update if episodes else config.env.num_envs
    # Grouped episodes need each copy reset from its own seed, which only one-env-per-copy allows.
    env = make_vector_env(config.env.id, num_envs, "sync" if grouped else config.env.vectorization)
    actions = action_spec(env.single_action_space)
    policy = _make_policy(config, env, actions, algorithm_class)
    algorithm = algorithm_class(policy, config)
    tracker = EpisodeTracker(num_envs, train_config.solve_window, train_config.target_return)
    seed_source = np.random.default_rng(train_config.seed)
    collector = _make_collector(config, env, actions, tracker, episodes)
    output_dir = Path(output.dir)
    logger = _open_logger(config, output_dir, num_envs) if write_files else None

    tracker.started = started
    updates = 0
    try:
        while tracker.env_steps < train_config.total_steps:
            progress = tracker.env_steps / train_config.total_steps
            episodes_before = len(tracker.returns)
            seeds = _episode_seeds(seed_source, num_envs, config.algorithm.group_size, grouped) if episodes else None
            rollout = collector.collect(policy, seeds) if episodes else collector.collect(policy)
            batch = build_batch(rollout, policy, config.env.reward_scale)
            metrics = algorithm.update(batch, progress)
            updates += 1
            if logger is not None and (
                updates % output.log_every == 0 or tracker.env_steps >= train_config.total_steps
            ):
                logger.log(_metrics_row(tracker, updates, episodes_before, started, metrics))
                logger.advance(
                    min(tracker.env_steps, train_config.total_steps), {"return": tracker.recent_mean() or 0.0}
                )
            if train_config.stop_at_target and tracker.solved_at_step is not None:
                break
    finally:
        env.close()
        if logger is not None:
            _close_logger(logger, tracker, config)
    seconds = time.perf_counter() - started
    if write_files and output.plots:
        _plot_run(output_dir)
    return _result(tracker, updates, seconds, output_dir if write_files else None, policy)


def _resolve_config(config: ControlConfig | str | Path | dict | None, overrides: list[str] | None) -> ControlConfig:
    """Return `config` itself, or the recipe it names loaded with `overrides` applied."""
    if not isinstance(config, ControlConfig):
        return load_control_config(config, overrides)
    if overrides:
        raise ValueError("overrides apply to recipes; edit the ControlConfig object directly instead")
    return config


def _make_policy(config: ControlConfig, env, actions, algorithm_class: type[OnPolicyAlgorithm]) -> ActorCritic:
    """Return the run's actor-critic, with a critic only where the algorithm uses one."""
    return ActorCritic(
        env.single_observation_space.shape[0],
        actions,
        config.policy.hidden_sizes,
        config.policy.activation,
        config.policy.orthogonal_init,
        config.policy.log_std_init,
        critic=algorithm_class.uses_critic or (config.algorithm.name == "reinforce" and config.algorithm.baseline),
    )


def _make_collector(
    config: ControlConfig, env, actions, tracker: EpisodeTracker, episodes: bool
) -> EpisodeCollector | StepCollector:
    """Return a collector of whole episodes or of `train.rollout_steps` steps per update."""
    if episodes:
        return EpisodeCollector(env, actions, tracker)
    return StepCollector(env, actions, tracker, config.train.rollout_steps, config.train.seed)


def _open_logger(config: ControlConfig, output_dir: Path, num_envs: int) -> MetricsLogger:
    """Return the run's metrics logger, after claiming `output_dir` and writing `config.yaml`."""
    train_config, output = config.train, config.output
    # An earlier run's files are never silently replaced: refuse, or remove them with output.overwrite.
    claim_output_dir(output_dir, output.overwrite)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    logger = MetricsLogger(output_dir, train_config.total_steps, 0, output.progress, trackers=Trackers.of(config))
    logger.write(
        f"polo control: {config.algorithm.name} on {config.env.id}, {num_envs} envs, "
        f"{train_config.total_steps:,} steps, writing to {output_dir}"
    )
    return logger


def _metrics_row(tracker: EpisodeTracker, updates: int, episodes_before: int, started: float, metrics: dict) -> dict:
    """Return the metrics row for the latest update: episodes it finished, throughput, the algorithm's metrics."""
    elapsed = time.perf_counter() - started
    new_returns = tracker.returns[episodes_before:]
    return {
        "step": tracker.env_steps,
        "update": updates,
        "episodes": len(tracker.returns),
        "episode_return/mean": float(np.mean(new_returns)) if new_returns else None,
        "episode_return/recent": tracker.recent_mean(),
        "episode_length/mean": float(np.mean(tracker.lengths[episodes_before:])) if new_returns else None,
        "steps_per_second": tracker.env_steps / max(elapsed, 1e-9),
        "time": elapsed,
        **metrics,
    }


def _close_logger(logger: MetricsLogger, tracker: EpisodeTracker, config: ControlConfig) -> None:
    """Close the logger, first reporting when (if ever) the run was solved."""
    train_config = config.train
    if tracker.solved_at_step is not None:
        logger.write(
            f"solved: mean return of the last {train_config.solve_window} episodes reached "
            f"{train_config.target_return} after {tracker.solved_at_step:,} steps ({tracker.solved_at_seconds:.1f} s)"
        )
    logger.close()


def _plot_run(output_dir: Path) -> None:
    """Draw the run's plots from the metrics in `output_dir`."""
    from polo.control.plots import plot_control_run

    plot_control_run(output_dir)


def _result(
    tracker: EpisodeTracker, updates: int, seconds: float, output_dir: Path | None, policy: ActorCritic
) -> ControlResult:
    """Return the `ControlResult` of a finished run."""
    return ControlResult(
        env_steps=tracker.env_steps,
        updates=updates,
        seconds=seconds,
        solved_at_step=tracker.solved_at_step,
        solved_at_seconds=tracker.solved_at_seconds,
        episode_returns=list(tracker.returns),
        episode_end_steps=list(tracker.end_steps),
        output_dir=output_dir,
        policy=policy,
    )


def _episode_seeds(source: np.random.Generator, num_envs: int, group_size: int, grouped: bool) -> list[int] | int:
    """Return reset seeds: one per group repeated `group_size` times (GRPO), or one for the vector env."""
    if not grouped:
        return int(source.integers(2**31 - 1))
    group_seeds = source.integers(2**31 - 1, size=num_envs // group_size)
    return [int(seed) for seed in np.repeat(group_seeds, group_size)]
