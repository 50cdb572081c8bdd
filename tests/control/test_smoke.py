"""A few hundred environment steps of every algorithm, through the public entry points."""

import json
from pathlib import Path

import pytest
import torch

from polo.cli import main
from polo.config import ConfigError
from polo.control import load_control_config, train

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FAST = ["train.rollout_steps=16", "train.epochs=2", "output.progress=false", "output.report_to=[]"]


@pytest.mark.parametrize("algorithm", ["reinforce", "a2c", "trpo", "ppo", "grpo"])
def test_every_algorithm_runs_on_cartpole(algorithm, tmp_path):
    overrides = FAST + [
        f"output.dir={tmp_path}",
        "train.total_steps=300",
        "train.episodes_per_update=8",
        "algorithm.group_size=4",
    ]
    result = train(RECIPES / f"{algorithm}_cartpole.yaml", overrides)
    assert result.env_steps >= 300 and result.updates >= 1 and result.episode_returns
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == result.env_steps and "loss/policy" in rows[-1]
    assert (tmp_path / "return.png").exists() and (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize("recipe", ["ppo_pendulum.yaml", "ppo_acrobot.yaml"])
def test_ppo_runs_on_pendulum_and_acrobot(recipe):
    result = train(
        RECIPES / recipe,
        ["env.num_envs=2", "train.total_steps=200", "train.rollout_steps=50", "train.epochs=1"],
        write_files=False,
    )
    # Two rollouts of 50 steps in each of 2 environments, each followed by one update.
    assert (result.env_steps, result.updates) == (200, 2)
    # The second update moved the policy: the same run stopped after one update ends elsewhere.
    one = train(
        RECIPES / recipe,
        ["env.num_envs=2", "train.total_steps=100", "train.rollout_steps=50", "train.epochs=1"],
        write_files=False,
    )
    assert one.updates == 1
    after_two = dict(result.policy.named_parameters())
    assert any(not torch.equal(value, after_two[name]) for name, value in one.policy.named_parameters())


def test_cli_runs_a_recipe_and_rejects_unknown_keys(tmp_path, capsys):
    args = ["control", str(RECIPES / "a2c_cartpole.yaml"), "train.total_steps=100", f"output.dir={tmp_path}", *FAST]
    assert main(args) == 0
    assert "steps in" in capsys.readouterr().out
    assert main(["control", str(RECIPES / "a2c_cartpole.yaml"), "train.totl_steps=100"]) == 2
    assert "train.totl_steps" in capsys.readouterr().err


def test_config_errors_name_the_bad_value():
    with pytest.raises(ConfigError, match="algorithm.name"):
        load_control_config(None, ["algorithm.name=sac"])
    with pytest.raises(ConfigError, match="multiple of"):
        load_control_config(None, ["algorithm.name=grpo", "algorithm.group_size=3", "train.episodes_per_update=16"])


def test_a_second_run_into_the_same_directory_is_refused_unless_overwrite(tmp_path):
    overrides = FAST + [f"output.dir={tmp_path}", "train.total_steps=100", "output.plots=false"]
    train(RECIPES / "a2c_cartpole.yaml", overrides)
    first = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(
        ConfigError,
        match=r"already holds a run \(.*metrics.jsonl.*\): "
        r"replace it with output.overwrite=true, or pick a new output.dir",
    ):
        train(RECIPES / "a2c_cartpole.yaml", overrides)
    assert (tmp_path / "metrics.jsonl").read_text() == first  # nothing lost
    train(RECIPES / "a2c_cartpole.yaml", overrides + ["output.overwrite=true"])
    assert (tmp_path / "metrics.jsonl").read_text() != first


def test_a_run_leaves_torch_with_the_threads_it_had(tmp_path):
    """`train.threads` (1 by default here) holds for the run only: the count is one setting for the whole process
    and decides how reductions split their sums, so a count left behind changed a later run's weights."""
    before = torch.get_num_threads()
    torch.set_num_threads(2 if before != 2 else 3)
    try:
        expected = torch.get_num_threads()
        train(RECIPES / "a2c_cartpole.yaml", ["train.total_steps=32", "train.threads=1", *FAST], write_files=False)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
