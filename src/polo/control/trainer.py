"""The one on-policy trainer: a step is collect → build the batch → the algorithm's update (the loop around it,
logging, stop signals and callbacks are `polo.runtime.lifecycle`'s).

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

# Imported for their @register_algorithm: each adds its class to ALGORITHMS.
from polo.control import a2c, grpo, ppo, reinforce, trpo  # noqa: F401
from polo.control.base import OnPolicyAlgorithm
from polo.control.config import ALGORITHMS, ControlConfig, config_to_dict, load_control_config
from polo.control.envs import action_spec, make_vector_env
from polo.control.policies import ActorCritic
from polo.control.rollout import EpisodeCollector, EpisodeTracker, StepCollector, build_batch
from polo.runtime.callbacks import run_callbacks
from polo.runtime.checkpoint import claim_output_dir
from polo.runtime.device import torch_threads
from polo.runtime.lifecycle import Cadence, Ending, StepReport, run_lifecycle, snapshot_config
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
    callbacks: list | None = None,
) -> ControlResult:
    """Run one classic-control training run and return its `ControlResult`.

    `config` is a `ControlConfig`, or a recipe (YAML path or mapping) to which `overrides`
    (`dotted.key=value`) are applied. With `write_files=False` nothing is written to disk
    (no metrics, plots or TensorBoard): for benchmarks and tests. A run that writes holds its
    `output.dir` against a second run from the start (`polo.runtime.run_lock`). `callbacks` are
    called after every update (`polo.runtime.callbacks`; after those `output.callbacks` names).
    """
    config = _resolve_config(config, overrides)
    output_dir = config.output.dir if write_files else None
    with torch_threads(config.train.threads):  # the caller's thread count comes back after the run
        return run_lifecycle(
            lambda rollback: ControlTrainer(config, write_files),
            output_dir,
            run_callbacks(config, callbacks),
            "stopping after this update (polo control keeps no checkpoint: the run starts again)",
        )


class ControlTrainer:
    """A control run as the lifecycle drives it (`polo.runtime.lifecycle.Trainer`): a step is one update.

    The run ends after `train.total_steps` environment steps (or once solved, with
    `train.stop_at_target`); it keeps no checkpoint and evaluates nothing held out.
    """

    name, start_step, eval_before = "polo control", 0, None

    def __init__(self, config: ControlConfig, write_files: bool):
        self.started = time.perf_counter()  # "seconds to solve" include building the envs and networks
        train_config, output = config.train, config.output
        self.config, self.write_files = config, write_files
        _seed_everything(train_config.seed)
        algorithm_class = ALGORITHMS[config.algorithm.name]
        self.episodes = algorithm_class.collects == "episodes"
        self.grouped = config.algorithm.name == "grpo"
        self.num_envs = train_config.episodes_per_update if self.episodes else config.env.num_envs
        # Grouped episodes need each copy reset from its own seed, which only one-env-per-copy allows.
        self.env = make_vector_env(config.env.id, self.num_envs, "sync" if self.grouped else config.env.vectorization)
        actions = action_spec(self.env.single_action_space)
        self.policy = _make_policy(config, self.env, actions, algorithm_class)
        self.algorithm = algorithm_class(self.policy, config)
        self.tracker = EpisodeTracker(self.num_envs, train_config.solve_window, train_config.target_return)
        self.seed_source = np.random.default_rng(train_config.seed)
        self.collector = _make_collector(config, self.env, actions, self.tracker, self.episodes)
        self.output_dir = Path(output.dir) if write_files else None
        self.trackers = Trackers.of(config)
        self.cadence = Cadence(total_steps=train_config.total_steps, resumable=False, progress=output.progress)
        if self.output_dir is not None:
            # An earlier run's files are never silently replaced: refuse, or remove them with output.overwrite.
            claim_output_dir(self.output_dir, output.overwrite)
            snapshot_config(self.output_dir, config_to_dict(config))
        self.tracker.started = self.started
        self.updates = 0

    def banner(self) -> str:
        config = self.config
        return (
            f"polo control: {config.algorithm.name} on {config.env.id}, {self.num_envs} envs, "
            f"{config.train.total_steps:,} steps, writing to {config.output.dir}"
        )

    def finished(self, step: int) -> bool:
        train_config, tracker = self.config.train, self.tracker
        solved = train_config.stop_at_target and tracker.solved_at_step is not None
        return tracker.env_steps >= train_config.total_steps or solved

    def step(self, step: int) -> StepReport:
        """Collect a rollout, update on it; return the metrics row every `output.log_every` updates and at the end."""
        config, tracker = self.config, self.tracker
        progress = tracker.env_steps / config.train.total_steps
        episodes_before, solved_before = len(tracker.returns), tracker.solved_at_step
        seeds = (
            _episode_seeds(self.seed_source, self.num_envs, config.algorithm.group_size, self.grouped)
            if self.episodes
            else None
        )
        rollout = self.collector.collect(self.policy, seeds) if self.episodes else self.collector.collect(self.policy)
        batch = build_batch(rollout, self.policy, config.env.reward_scale)
        metrics = self.algorithm.update(batch, progress)
        self.updates += 1
        messages = [_solved_line(tracker, config)] if solved_before is None and tracker.solved_at_step else []
        if not (self.updates % config.output.log_every == 0 or tracker.env_steps >= config.train.total_steps):
            return StepReport(None, messages=messages)
        row = _metrics_row(tracker, self.updates, episodes_before, self.started, metrics)
        position = min(tracker.env_steps, config.train.total_steps)
        return StepReport(row, messages=messages, summary={"return": tracker.recent_mean() or 0.0}, position=position)

    def judge(self, step: int, metrics: dict) -> str | None:
        return None

    def rollback(self, step: int, reason: str) -> None:
        raise RuntimeError(f"polo control does not roll back: {reason}")

    def evaluate(self, step: int) -> None:
        return None

    def save(self, step: int) -> None:
        return None

    def latest_checkpoint(self) -> None:
        return None

    def finish(self, ending: Ending) -> ControlResult:
        """Close the environments, draw the plots; return the result."""
        self.env.close()
        seconds = time.perf_counter() - self.started
        if self.output_dir is not None and self.config.output.plots:
            _plot_run(self.output_dir)
        return _result(self.tracker, self.updates, seconds, self.output_dir, self.policy)


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


def _solved_line(tracker: EpisodeTracker, config: ControlConfig) -> str:
    """Return the line that says when the run was solved."""
    train_config = config.train
    return (
        f"solved: mean return of the last {train_config.solve_window} episodes reached "
        f"{train_config.target_return} after {tracker.solved_at_step:,} steps ({tracker.solved_at_seconds:.1f} s)"
    )


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
