"""The actor-critic: log-probs, entropies and KLs against torch.distributions; the flat buffer."""

import numpy as np
import torch

from polo.control.envs import ActionSpec
from polo.control.policies import ActorCritic, Categorical, DiagonalGaussian


def test_categorical_matches_torch_distributions():
    logits = torch.randn(5, 3)
    other = torch.randn(5, 3)
    actions = torch.tensor([0, 2, 1, 1, 0])
    reference = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(Categorical.log_prob(logits, actions), reference.log_prob(actions))
    torch.testing.assert_close(Categorical.entropy(logits), reference.entropy())
    expected_kl = torch.distributions.kl_divergence(reference, torch.distributions.Categorical(logits=other))
    torch.testing.assert_close(Categorical.kl(logits, other), expected_kl)


def test_gaussian_matches_torch_distributions():
    mean, other_mean = torch.randn(4, 2), torch.randn(4, 2)
    log_std, other_log_std = torch.tensor([0.1, -0.3]), torch.tensor([-0.2, 0.4])
    actions = torch.randn(4, 2)
    reference = torch.distributions.Normal(mean, log_std.exp())
    torch.testing.assert_close(DiagonalGaussian.log_prob(mean, actions, log_std), reference.log_prob(actions).sum(-1))
    torch.testing.assert_close(DiagonalGaussian.entropy(mean, log_std), reference.entropy().sum(-1))
    other = torch.distributions.Normal(other_mean, other_log_std.exp())
    expected_kl = torch.distributions.kl_divergence(reference, other).sum(-1)
    torch.testing.assert_close(DiagonalGaussian.kl(mean, other_mean, log_std, other_log_std), expected_kl)


def test_parameters_and_gradients_share_one_flat_buffer():
    policy = ActorCritic(3, ActionSpec(discrete=False, shape=(2,), low=-np.ones(2), high=np.ones(2)), [8])
    optimizer = torch.optim.SGD([policy.flat_all], lr=1.0)
    before = [param.detach().clone() for param in policy.parameters()]
    observations = torch.randn(6, 3)
    loss = policy.actor(observations).pow(2).sum() + policy.value(observations).sum() + policy.log_std.sum()
    policy.flat_all.grad.zero_()
    loss.backward()
    optimizer.step()
    for param, old in zip(policy.parameters(), before):
        torch.testing.assert_close(param.detach(), old - param.grad)  # the SGD step reached every parameter
    assert policy.flat_actor.numel() + policy.flat_critic.numel() == policy.flat_all.numel()


def test_act_returns_numpy_actions_of_the_right_shape():
    discrete = ActorCritic(4, ActionSpec(discrete=True, num_actions=3), [8])
    actions = discrete.act(np.zeros((5, 4), dtype=np.float32))
    assert actions.shape == (5,) and actions.dtype == np.int64 and set(actions.tolist()) <= {0, 1, 2}
    continuous = ActorCritic(
        3, ActionSpec(discrete=False, shape=(1,), low=-np.ones(1), high=np.ones(1)), [8], critic=False
    )
    assert continuous.act(np.zeros((2, 3), dtype=np.float32)).shape == (2, 1) and continuous.critic is None
