"""GRPO for control: the group baseline over whole episodes, and same-seed groups."""

import math

import numpy as np
import torch

from polo.control.envs import action_spec, make_vector_env
from polo.control.grpo import episode_group_advantages
from polo.control.rollout import Batch, EpisodeCollector, EpisodeTracker
from polo.control.trainer import _episode_seeds


def episodes_batch(lengths: list[int], reward: float = 1.0) -> Batch:
    """A batch of whole episodes of the given lengths, every step worth `reward`."""
    num_segments, longest = len(lengths), max(lengths)
    mask = torch.zeros(num_segments, longest, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, :length] = True
    segment, position = mask.nonzero(as_tuple=True)
    count = int(mask.sum())
    return Batch(
        observations=torch.zeros(count, 4),
        actions=torch.zeros(count, dtype=torch.long),
        old_logprobs=torch.zeros(count),
        rewards=torch.where(mask, reward, 0.0),
        mask=mask,
        segment=segment,
        position=position,
        values=None,
        last_values=None,
    )


def test_group_baseline_normalises_episode_returns_within_each_group():
    # Two groups of 4 episodes: returns 10, 20, 30, 40 (mean 25, std √(500/3)) and 5, 5, 5, 5 (flat).
    batch = episodes_batch([10, 20, 30, 40, 5, 5, 5, 5])
    advantages, returns = episode_group_advantages(batch, group_size=4)
    assert returns.tolist() == [10.0, 20.0, 30.0, 40.0, 5.0, 5.0, 5.0, 5.0]
    std = math.sqrt(((15**2 + 5**2) * 2) / 3)
    expected_episode = [(r - 25.0) / (std + 1e-4) for r in (10, 20, 30, 40)] + [0.0] * 4
    # Every step of an episode carries its episode's advantage.
    expected = torch.tensor([a for a, n in zip(expected_episode, [10, 20, 30, 40, 5, 5, 5, 5]) for _ in range(n)])
    torch.testing.assert_close(advantages, expected)


def test_dr_grpo_variant_only_centres():
    batch = episodes_batch([1, 3])
    advantages, _ = episode_group_advantages(batch, group_size=2, scale_by_std=False)
    assert advantages.tolist() == [-1.0, 1.0, 1.0, 1.0]


def test_a_group_shares_its_start_state():
    env = make_vector_env("CartPole-v1", 4, "sync")
    seeds = _episode_seeds(np.random.default_rng(0), 4, group_size=2, grouped=True)
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]

    class RandomPolicy:
        def act(self, observations):
            return np.random.default_rng(1).integers(2, size=len(observations))

    rollout = EpisodeCollector(env, action_spec(env.single_action_space), EpisodeTracker(4)).collect(
        RandomPolicy(), seeds
    )
    first = rollout.observations[0]
    np.testing.assert_array_equal(first[0], first[1])
    np.testing.assert_array_equal(first[2], first[3])
    assert not np.array_equal(first[0], first[2])
    # Exactly one episode per copy: each column is valid up to and including its first end.
    for column in range(4):
        ends = np.flatnonzero(rollout.done[:, column])
        assert rollout.valid[: ends[0] + 1, column].all() and not rollout.valid[ends[0] + 1 :, column].any()
    env.close()
