"""Collecting experience from vector environments, and laying it out as episode segments.

A rollout is stored time-major, `(T, num_envs)`, as the environments produce it. For the
maths it is re-laid as *segments*: each maximal run of one environment copy's steps that
belong to one episode becomes a row of a `(segments, length)` tensor, right-padded with a
mask — the same `(batch, seq)` + mask layout the language-model trainer uses for completions.
`polo.core.gae_advantages` and `polo.core.discounted_returns` then apply unchanged, with a
per-segment bootstrap value: V(s_next) where the rollout cut an episode or the time limit
truncated it, 0 where it terminated.

Two ways to collect, shared by every algorithm:
    `StepCollector`    — T steps of every copy, episodes running on across updates (A2C, TRPO, PPO)
    `EpisodeCollector` — every copy plays exactly one episode from a given reset seed (REINFORCE, GRPO)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from polo.control.envs import ActionSpec


@dataclass
class Rollout:
    """Raw experience, time-major. T steps of N copies; observations has T + 1 rows (the last is s_T).

    valid[t, n] is False for the reset steps of next-step autoreset (and, when collecting whole
    episodes, for steps after a copy's episode ended); those steps are no transitions at all.
    """

    observations: np.ndarray  # (T + 1, N, observation_size) float32
    actions: np.ndarray  # (T, N) int64 or (T, N, action_dim) float32
    rewards: np.ndarray  # (T, N) float32, as the environment gave them
    terminated: np.ndarray  # (T, N) bool: the episode ended in a terminal state (no bootstrap)
    done: np.ndarray  # (T, N) bool: terminated or truncated
    valid: np.ndarray  # (T, N) bool


class EpisodeTracker:
    """Running episode returns and lengths per copy; records finished episodes and the solve point."""

    def __init__(self, num_envs: int, window: int = 20, target: float | None = None):
        self.running_return = np.zeros(num_envs, dtype=np.float64)
        self.running_length = np.zeros(num_envs, dtype=np.int64)
        self.returns: list[float] = []
        self.lengths: list[int] = []
        self.end_steps: list[int] = []  # env steps taken (by all copies) when each episode ended
        self.recent: deque[float] = deque(maxlen=window)
        self.target = target
        self.env_steps = 0
        self.started = time.perf_counter()
        self.solved_at_step: int | None = None
        self.solved_at_seconds: float | None = None

    def reset_running(self) -> None:
        self.running_return[:] = 0.0
        self.running_length[:] = 0

    def record(self, rewards: np.ndarray, done: np.ndarray, valid: np.ndarray) -> None:
        """Account one vector step: add rewards of valid copies, close the episodes that ended."""
        self.env_steps += int(valid.sum())
        self.running_return += np.where(valid, rewards, 0.0)
        self.running_length += valid
        ended = done & valid
        if ended.any():
            for index in np.flatnonzero(ended):
                self.returns.append(float(self.running_return[index]))
                self.lengths.append(int(self.running_length[index]))
                self.end_steps.append(self.env_steps)
                self.recent.append(self.returns[-1])
            self.running_return[ended] = 0.0
            self.running_length[ended] = 0
            if (
                self.solved_at_step is None
                and self.target is not None
                and len(self.recent) == self.recent.maxlen
                and sum(self.recent) / len(self.recent) >= self.target
            ):
                self.solved_at_step = self.env_steps
                self.solved_at_seconds = time.perf_counter() - self.started

    def recent_mean(self) -> float | None:
        """Return the mean return of the last `window` episodes (None before the first one)."""
        return sum(self.recent) / len(self.recent) if self.recent else None


def _observations(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


class StepCollector:
    """Collects `num_steps` steps of every copy; episodes carry over from one call to the next."""

    def __init__(
        self, env: gym.vector.VectorEnv, actions: ActionSpec, tracker: EpisodeTracker, num_steps: int, seed: int
    ):
        self.env = env
        self.actions = actions
        self.tracker = tracker
        self.num_steps = num_steps
        observations, _ = env.reset(seed=seed)
        self.observations = _observations(observations)
        self.previous_done = np.zeros(env.num_envs, dtype=bool)

    def collect(self, policy) -> Rollout:
        """Return the next `Rollout` of `num_steps` steps, sampling actions from `policy.act`."""
        steps, num_envs = self.num_steps, self.env.num_envs
        observations = np.empty((steps + 1, num_envs, self.observations.shape[-1]), dtype=np.float32)
        rewards = np.empty((steps, num_envs), dtype=np.float32)
        terminated = np.empty((steps, num_envs), dtype=bool)
        done = np.empty((steps, num_envs), dtype=bool)
        valid = np.empty((steps, num_envs), dtype=bool)
        actions = []
        current, previous_done = self.observations, self.previous_done
        for t in range(steps):
            observations[t] = current
            action = policy.act(current)
            actions.append(action)
            current, reward, is_terminal, is_truncated, _ = self.env.step(self.actions.to_env(action))
            current = _observations(current)
            step_done = is_terminal | is_truncated
            is_valid = ~previous_done  # a step right after an episode's end is the autoreset
            rewards[t] = reward
            terminated[t] = is_terminal
            done[t] = step_done
            valid[t] = is_valid
            self.tracker.record(reward, step_done, is_valid)
            previous_done = step_done
        observations[steps] = current
        self.observations, self.previous_done = current, previous_done
        return Rollout(observations, np.stack(actions), rewards, terminated, done, valid)


class EpisodeCollector:
    """Runs every copy for exactly one episode, each reset from its own seed, until all have ended."""

    def __init__(
        self, env: gym.vector.VectorEnv, actions: ActionSpec, tracker: EpisodeTracker, max_steps: int = 100_000
    ):
        self.env = env
        self.actions = actions
        self.tracker = tracker
        self.max_steps = max_steps

    def collect(self, policy, seeds: list[int] | int) -> Rollout:
        """Return a `Rollout` of one episode per copy; `seeds` is one per copy, or one for the vector env."""
        current, _ = self.env.reset(seed=seeds)
        current = _observations(current)
        self.tracker.reset_running()
        active = np.ones(self.env.num_envs, dtype=bool)
        observations, actions, rewards, terminated, done, valid = [], [], [], [], [], []
        while active.any():
            if len(rewards) >= self.max_steps:
                raise RuntimeError(
                    f"an episode ran past {self.max_steps} steps; does the environment have a time limit?"
                )
            observations.append(current)
            action = policy.act(current)
            actions.append(action)
            current, reward, is_terminal, is_truncated, _ = self.env.step(self.actions.to_env(action))
            current = _observations(current)
            step_done = is_terminal | is_truncated
            rewards.append(reward)
            terminated.append(is_terminal)
            done.append(step_done)
            valid.append(active.copy())
            self.tracker.record(reward, step_done, active)
            active &= ~step_done
        observations.append(current)
        return Rollout(
            np.stack(observations),
            np.stack(actions),
            np.asarray(rewards, dtype=np.float32),
            np.asarray(terminated, dtype=bool),
            np.asarray(done, dtype=bool),
            np.asarray(valid, dtype=bool),
        )


@dataclass
class Batch:
    """One update's transitions: flat `(M, ...)` tensors plus the `(S, L)` episode-segment layout.

    M valid transitions, S segments, L the longest segment. `segment` and `position` say where
    flat entry i sits in the padded layout; `pad` and `flatten` convert between the two.
    """

    observations: torch.Tensor  # (M, observation_size)
    actions: torch.Tensor  # (M,) int64 or (M, action_dim)
    old_logprobs: torch.Tensor  # (M,) log π_old(a|s) of the collecting policy
    rewards: torch.Tensor  # (S, L), scaled by env.reward_scale, 0 at padding
    mask: torch.Tensor  # (S, L) bool
    segment: torch.Tensor  # (M,) int64
    position: torch.Tensor  # (M,) int64
    values: torch.Tensor | None  # (M,) V(s) before the update (critic algorithms)
    last_values: torch.Tensor | None  # (S,) bootstrap after each segment's last step; 0 if it terminated

    @property
    def num_transitions(self) -> int:
        return self.observations.shape[0]

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """Return flat values `(M,)` placed into the segment layout `(S, L)`, 0 at padding."""
        padded = flat.new_zeros(self.mask.shape)
        padded[self.segment, self.position] = flat
        return padded

    def flatten(self, padded: torch.Tensor) -> torch.Tensor:
        """Return the valid entries `(M,)` of a segment-layout tensor `(S, L)`."""
        return padded[self.segment, self.position]


def segment_layout(done: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (keep, segment, position, last) that lay valid time-major steps out as episode segments.

    keep `(M,)` indexes the valid steps in env-major order (n·T + t); segment and position
    `(M,)` are each kept step's row and column in the padded `(S, L)` layout; last `(S,)`
    indexes (into keep) each segment's final step. A segment starts at t = 0 and after a step
    that ended an episode or was invalid.

    Shapes: done, valid (T, N) bool.
    """
    steps = done.shape[0]
    starts = np.empty_like(done)
    starts[0] = True
    starts[1:] = done[:-1] | ~valid[:-1]
    keep = np.flatnonzero(valid.T.reshape(-1))
    kept_starts = starts.T.reshape(-1)[keep]
    if keep.size == 0:
        raise RuntimeError(f"a rollout of {steps} steps held no valid transition")
    segment = np.cumsum(kept_starts) - 1
    firsts = np.flatnonzero(kept_starts)
    position = np.arange(keep.size) - firsts[segment]
    last = np.append(firsts[1:] - 1, keep.size - 1)
    return keep, segment, position, last


def build_batch(rollout: Rollout, policy, reward_scale: float = 1.0) -> Batch:
    """Return the `Batch` of a rollout: segment layout, old log-probs and (with a critic) values.

    Log-probs and values are computed here in one batched forward pass each, rather than
    step by step during collection: the policy does not change within a rollout.
    """
    steps, num_envs = rollout.done.shape
    keep, segment, position, last = segment_layout(rollout.done, rollout.valid)
    time_index, env_index = keep % steps, keep // steps
    observations = torch.from_numpy(rollout.observations[time_index, env_index])
    actions = torch.from_numpy(rollout.actions[time_index, env_index])
    num_segments, length = int(segment[-1]) + 1, int(position.max()) + 1
    segment_t, position_t = torch.from_numpy(segment), torch.from_numpy(position)
    rewards = torch.zeros(num_segments, length)
    rewards[segment_t, position_t] = torch.from_numpy(rollout.rewards[time_index, env_index] * np.float32(reward_scale))
    mask = torch.zeros(num_segments, length, dtype=torch.bool)
    mask[segment_t, position_t] = True
    with torch.no_grad():
        old_logprobs = policy.log_prob(policy.actor(observations), actions)
        values = last_values = None
        if policy.critic is not None:
            all_values = policy.value(
                torch.from_numpy(rollout.observations.reshape(-1, rollout.observations.shape[-1]))
            )
            all_values = all_values.reshape(steps + 1, num_envs)
            values = all_values[time_index, env_index]
            last_time, last_env = time_index[last], env_index[last]
            bootstrap = all_values[last_time + 1, last_env]
            last_values = torch.where(torch.from_numpy(rollout.terminated[last_time, last_env]), 0.0, bootstrap)
    return Batch(observations, actions, old_logprobs, rewards, mask, segment_t, position_t, values, last_values)
