"""TRPO's update keeps the exact KL within the trust region and improves the surrogate."""

import numpy as np
import pytest
import torch

from polo.control.envs import ActionSpec
from polo.control.policies import ActorCritic
from polo.control.trpo import TrustRegion, trpo_step


@pytest.mark.parametrize("discrete", [True, False])
@pytest.mark.parametrize("max_kl", [0.001, 0.01, 0.05])
def test_trpo_step_respects_the_kl_radius(discrete, max_kl):
    torch.manual_seed(0)
    if discrete:
        actions_spec = ActionSpec(discrete=True, num_actions=3)
    else:
        actions_spec = ActionSpec(discrete=False, shape=(2,), low=-np.ones(2), high=np.ones(2))
    policy = ActorCritic(4, actions_spec, [16], critic=False)
    observations = torch.randn(256, 4)
    with torch.no_grad():
        old_outputs = policy.actor(observations)
        old_log_std = None if discrete else policy.log_std.detach().clone()
        actions = policy.act(observations.numpy())
    actions = torch.from_numpy(actions)
    advantages = torch.randn(256)
    before = policy.flat_actor.detach().clone()
    metrics = trpo_step(policy, observations, actions, advantages, TrustRegion(max_kl))
    assert metrics["step_accepted"] == 1.0
    assert not torch.equal(before, policy.flat_actor.detach())
    with torch.no_grad():
        kl = policy.kl(old_outputs, old_log_std, policy.actor(observations)).mean()
    assert 0.0 < float(kl) <= max_kl
    assert metrics["kl"] == pytest.approx(float(kl))
    assert metrics["surrogate_improvement"] > 0
