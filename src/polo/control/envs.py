"""Gymnasium vector environments, and what the policy needs to know about their spaces.

Every environment here autoresets on the *next* step (Gymnasium's default `NEXT_STEP` mode):
the step that ends an episode returns its true final observation, and the following step
resets that copy, ignores its action and returns reward 0. The rollout code marks such reset
steps invalid, so the final observation is always at hand for bootstrapping a truncated
episode, with no `final_obs` bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from polo.config import ConfigError


@dataclass(frozen=True)
class ActionSpec:
    """The single-copy action space: `num_actions` choices, or a box of `shape` in [low, high]."""

    discrete: bool
    num_actions: int = 0
    shape: tuple[int, ...] = ()
    low: np.ndarray | None = None
    high: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Return the number of policy outputs: logits for discrete, means for continuous."""
        return self.num_actions if self.discrete else int(np.prod(self.shape))

    def to_env(self, actions: np.ndarray) -> np.ndarray:
        """Return sampled actions `(num_envs, ...)` as the environment accepts them (boxes are clipped)."""
        if self.discrete:
            return actions
        return np.clip(actions, self.low, self.high)


def action_spec(space: gym.Space) -> ActionSpec:
    """Return the `ActionSpec` of a single-copy Gymnasium action space (Discrete or Box)."""
    if isinstance(space, gym.spaces.Discrete):
        return ActionSpec(discrete=True, num_actions=int(space.n))
    if isinstance(space, gym.spaces.Box):
        return ActionSpec(
            discrete=False,
            shape=tuple(space.shape),
            low=space.low.astype(np.float32),
            high=space.high.astype(np.float32),
        )
    raise ConfigError(f"unsupported action space {space}; polo.control handles Discrete and Box actions")


def has_vector_entry_point(env_id: str) -> bool:
    """Return True when Gymnasium registers a numpy-vectorised implementation of `env_id`."""
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as error:
        raise ConfigError(f"env.id: unknown Gymnasium environment {env_id!r} ({error})") from None
    return spec.vector_entry_point is not None


def make_vector_env(env_id: str, num_envs: int, vectorization: str = "auto") -> gym.vector.VectorEnv:
    """Return `num_envs` copies of `env_id` stepping together, autoresetting on the next step.

    vectorization: "vector" uses Gymnasium's numpy-vectorised entry point (one array
    operation for all copies; copies cannot be reset from separate seeds), "sync" one Python
    environment per copy, "auto" the first where the environment has one, else the second.
    """
    if vectorization not in ("auto", "vector", "sync"):
        raise ConfigError(f"env.vectorization: {vectorization!r} is not one of auto, vector, sync")
    vectorised = has_vector_entry_point(env_id)
    if vectorization == "vector" and not vectorised:
        raise ConfigError(f"env.vectorization: {env_id} has no vector entry point; use sync or auto")
    mode = "vector_entry_point" if vectorization != "sync" and vectorised else "sync"
    env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode)
    autoreset = env.metadata.get("autoreset_mode")
    if autoreset is not None and autoreset != gym.vector.AutoresetMode.NEXT_STEP:
        raise ConfigError(f"{env_id} autoresets in mode {autoreset}; polo.control expects NEXT_STEP")
    if not isinstance(env.single_observation_space, gym.spaces.Box) or len(env.single_observation_space.shape) != 1:
        raise ConfigError(f"{env_id}: polo.control needs flat Box observations, got {env.single_observation_space}")
    return env
