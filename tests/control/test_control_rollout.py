"""Episode segments from time-major rollouts, and returns / GAE computed on them."""

import numpy as np
import torch

from polo.control.envs import ActionSpec
from polo.control.policies import ActorCritic
from polo.control.rollout import Rollout, build_batch, segment_layout
from polo.core.advantages import discounted_returns, gae_advantages


def test_segment_layout_splits_at_episode_ends_and_drops_reset_steps():
    # Two envs, T = 4. Env 0: an episode ends at t=1, t=2 is the autoreset step (invalid), a new
    # episode starts at t=3. Env 1: one episode running through.
    done = np.array([[0, 0], [1, 0], [0, 0], [0, 0]], dtype=bool)
    valid = np.array([[1, 1], [1, 1], [0, 1], [1, 1]], dtype=bool)
    keep, segment, position, last = segment_layout(done, valid)
    # env-major flat index n*T + t: env 0 keeps t = 0, 1, 3; env 1 keeps t = 0..3.
    assert keep.tolist() == [0, 1, 3, 4, 5, 6, 7]
    assert segment.tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert position.tolist() == [0, 1, 0, 0, 1, 2, 3]
    assert last.tolist() == [1, 2, 6]


class ConstantCritic(ActorCritic):
    """A policy whose critic says V(s) = s[0], so bootstraps can be checked by hand."""

    def value(self, observations):
        return observations[:, 0]


def test_build_batch_bootstraps_truncations_and_rollout_cuts_but_not_terminations():
    policy = ConstantCritic(1, ActionSpec(discrete=True, num_actions=2), [4])
    # One env, T = 5: terminates at t=1 (reset step t=2), truncated at t=4. Observation = 10·t.
    observations = (10.0 * np.arange(6, dtype=np.float32)).reshape(6, 1, 1)
    rollout = Rollout(
        observations=observations,
        actions=np.zeros((5, 1), dtype=np.int64),
        rewards=np.ones((5, 1), dtype=np.float32),
        terminated=np.array([[0], [1], [0], [0], [0]], dtype=bool),
        done=np.array([[0], [1], [0], [0], [1]], dtype=bool),
        valid=np.array([[1], [1], [0], [1], [1]], dtype=bool),
    )
    batch = build_batch(rollout, policy, reward_scale=2.0)
    assert batch.mask.tolist() == [[True, True], [True, True]]
    assert batch.rewards.tolist() == [[2.0, 2.0], [2.0, 2.0]]
    # Segment 0 terminated: no bootstrap. Segment 1 truncated at t=4: V(s_5) = 50.
    assert batch.last_values.tolist() == [0.0, 50.0]
    assert batch.values.tolist() == [0.0, 10.0, 30.0, 40.0]

    # GAE on the segments, checked by hand with γ = 0.5, λ = 1 (Monte-Carlo minus V).
    advantages, returns = gae_advantages(
        batch.rewards, batch.pad(batch.values), batch.mask, 0.5, 1.0, batch.last_values
    )
    # Segment 0: R_1 = 2, R_0 = 2 + 0.5·2 = 3. Segment 1: R_1 = 2 + 0.5·50 = 27, R_0 = 2 + 0.5·27 = 15.5.
    assert batch.flatten(returns).tolist() == [3.0, 2.0, 15.5, 27.0]
    assert batch.flatten(advantages).tolist() == [3.0, -8.0, -14.5, -13.0]


def test_returns_to_go_on_a_known_episode_batch():
    # Two episodes of lengths 3 and 2 (padded), γ = 0.9.
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    returns = discounted_returns(rewards, mask, 0.9)
    # 3; 2 + 0.9·3 = 4.7; 1 + 0.9·4.7 = 5.23.  1; 5 + 0.9·1 = 5.9.
    torch.testing.assert_close(returns, torch.tensor([[5.23, 4.7, 3.0], [5.9, 1.0, 0.0]]))


def test_gae_lambda_zero_is_the_one_step_td_error():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages, _ = gae_advantages(rewards, values, mask, 0.9, 0.0, last_value=torch.tensor([2.0]))
    # δ_0 = 1 + 0.9·1 − 0.5 = 1.4; δ_1 = 0 + 0.9·1.5 − 1 = 0.35; δ_2 = 2 + 0.9·2 − 1.5 = 2.3.
    torch.testing.assert_close(advantages, torch.tensor([[1.4, 0.35, 2.3]]))
