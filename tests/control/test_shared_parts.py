"""Control uses polo's one explained variance, one optimizer and one registry of algorithms."""

from __future__ import annotations

import pytest
import torch

from polo import core
from polo.config import ConfigError
from polo.control import ALGORITHMS, load_control_config
from polo.control.base import explained_variance


def test_explained_variance_is_the_core_one_with_cleanrl_s_convention():
    target = torch.tensor([1.0, 2.0, 4.0, 7.0])
    predicted = torch.tensor([1.5, 2.0, 3.0, 7.5])
    # CleanRL: 1 - Var[y - ŷ] / Var[y], both population variances (numpy's default)
    expected = 1 - (target - predicted).var(unbiased=False) / target.var(unbiased=False)
    assert explained_variance(predicted, target) == pytest.approx(float(expected))
    assert explained_variance(predicted, target) == core.explained_variance(
        predicted[:, None], target[:, None], torch.ones(4, 1)
    )
    assert explained_variance(target, target) == 1.0
    assert explained_variance(torch.full_like(target, target.mean()), target) == pytest.approx(0.0)


def test_algorithm_names_are_the_registered_classes():
    assert sorted(ALGORITHMS.names()) == ["a2c", "grpo", "ppo", "reinforce", "trpo"]
    assert ALGORITHMS["ppo"].__name__ == "PPO" and ALGORITHMS["a2c"].collects == "steps"
    with pytest.raises(
        ConfigError, match=r"^algorithm.name: 'sac' is not a registered control algorithm; registered: "
    ):
        load_control_config(None, ["algorithm.name=sac"])
