"""A reward that exits, or returns a value float32 cannot hold, stops `polo.train` with an error naming the reward."""

from __future__ import annotations

import sys

import pytest
from test_trainer import tiny_config

import polo
from polo.rewards import RewardFunctionError


def exits(completion, row):
    sys.exit(0)


def huge(completions, **kwargs):
    return [1e39] * len(completions)


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (exits, r"^reward function 'exits' failed on sample 0 .*called sys\.exit\(0\)"),
        (huge, r"^reward function 'huge' failed on sample 0 .*returned 1e\+39, which is not finite in float32"),
    ],
)
def test_the_run_stops_naming_the_reward(tiny_model_dir, tmp_path, reward, message):
    config = tiny_config(
        tiny_model_dir,
        tmp_path / "run",
        train={"steps": 1},
        eval={"before": False, "after": False},
        output={"report_to": [], "plots": False},
    )
    with pytest.raises(RewardFunctionError, match=message):
        polo.train(config, reward_functions={reward: 1.0})
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step was logged as done
