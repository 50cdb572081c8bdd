"""Recipes, overrides and the clear errors for bad keys and values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from polo.cli import main
from polo.config import Config, ConfigError, load_config

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def write_gsm8k_folder(folder: Path, train_rows: int, test_rows: int) -> Path:
    """Write train.jsonl and test.jsonl in GSM8K's format (a question, a solution ending in #### N) to `folder`."""
    for name, count in (("train.jsonl", train_rows), ("test.jsonl", test_rows)):
        rows = [{"question": f"What is {i} + 2?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"} for i in range(count)]
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_every_recipe_loads(recipe, tmp_path, monkeypatch):
    import yaml

    # a gsm8k recipe reads $POLO_GSM8K_DIR: rows in GSM8K's format, as many as the recipes ask for, stand in for it
    monkeypatch.setenv("POLO_GSM8K_DIR", str(write_gsm8k_folder(tmp_path, 2000, 500)))

    from polo.finetune.dpo import load_dpo_config
    from polo.finetune.reward_model import load_reward_model_config
    from polo.finetune.sft import load_sft_config

    # the recipes of `polo sft`, `polo rm` and `polo dpo`; every other one is `polo train` or `polo control`
    finetune_loaders = {"sft": load_sft_config, "rm": load_reward_model_config, "dpo": load_dpo_config}
    command = recipe.stem.split("_")[1] if recipe.stem.startswith("rlhf_") else None  # rlhf_rm_samples -> rm
    if command in finetune_loaders:
        assert finetune_loaders[command](recipe).data.train_path
    elif "pipeline" in yaml.safe_load(
        recipe.read_text()
    ):  # an R1 pipeline (`polo pipeline`): every stage's recipe checked
        from polo.pipeline.recipe import load_pipeline

        assert load_pipeline(recipe).stages
    elif "env" in yaml.safe_load(recipe.read_text()):  # a Gymnasium control recipe (`polo control`)
        from polo.control.config import ControlConfig, load_control_config

        assert isinstance(load_control_config(recipe), ControlConfig)
    else:
        assert isinstance(load_config(recipe), Config)


def test_overrides_set_typed_values():
    config = load_config(
        None, ["train.learning_rate=3e-6", "algorithm.group_size=4", "task.operators=[+, '-']", "output.resume=true"]
    )
    assert config.train.learning_rate == 3e-6 and isinstance(config.train.learning_rate, float)
    assert config.algorithm.group_size == 4
    assert config.task.operators == ["+", "-"]
    assert config.output.resume is True


def test_unknown_key_names_it_and_the_valid_ones():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.learning_rat=1e-6"])
    message = str(error.value)
    assert "train.learning_rat" in message and "learning_rate" in message and "micro_batch_size" in message


def test_unknown_section_names_the_valid_sections():
    with pytest.raises(ConfigError, match="valid keys: model, task, rewards"):
        load_config({"trian": {"steps": 1}})


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        load_config(None, ["train.steps=ten"])
    with pytest.raises(ConfigError, match="output.resume: expected true or false"):
        load_config(None, ["output.resume=maybe"])


def test_bad_choice_names_the_valid_ones():
    with pytest.raises(ConfigError, match="seq_mean_token_mean, token_mean, seq_mean_token_sum_norm, micro_batch"):
        load_config(None, ["algorithm.loss_aggregation=mean"])


def test_groups_are_never_split_across_minibatches():
    with pytest.raises(ConfigError, match="divisible"):
        load_config(None, ["train.prompts_per_step=3", "train.num_minibatches=2"])


def test_missing_recipe_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  stepz: 3\n")
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polo: error: unknown config key 'train.stepz'") and "Traceback" not in err


def test_cli_reports_missing_model_in_one_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  name: {tmp_path / 'no-such-model'}\ntrain:\n  steps: 1\n")
    assert main(["train", str(recipe), f"output.dir={tmp_path / 'out'}"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_reward_override_accepts_import_paths_with_dots(tmp_path, monkeypatch):
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "scoring.py").write_text("def length_penalty(completion, row):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)  # validation imports the module, from the current directory as polo train would
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    config = load_config(None, ["rewards.my_pkg.scoring:length_penalty=0.25"])
    assert config.rewards == {"my_pkg.scoring:length_penalty": 0.25}


def test_algorithm_presets_fill_fields_and_explicit_keys_win():
    from polo.config import PRESETS

    dapo = load_config({"algorithm": {"name": "dapo"}}).algorithm
    assert (dapo.clip_eps_high, dapo.dynamic_sampling, dapo.loss_aggregation, dapo.overlong_buffer) == (
        0.28,
        True,
        "token_mean",
        0.2,
    )
    mine = load_config(
        {"algorithm": {"name": "dapo", "clip_eps_high": 0.3}}, ["algorithm.dynamic_sampling=false"]
    ).algorithm
    assert (mine.clip_eps_high, mine.dynamic_sampling, mine.loss_aggregation) == (0.3, False, "token_mean")
    assert load_config(None, ["algorithm.name=ppo"]).algorithm.advantage_estimator == "gae"
    assert load_config(None, ["algorithm.name=dr_grpo"]).algorithm.scale_rewards is False
    assert load_config(None, ["algorithm.name=gspo"]).algorithm.policy_loss == "gspo"
    for name in PRESETS:  # every preset is a valid configuration on its own
        assert load_config({"algorithm": {"name": name}}).algorithm.name == name


def test_unknown_algorithm_names_the_valid_ones():
    with pytest.raises(
        ConfigError,
        match="algorithm.name: 'ppo2' is not one of grpo, dr_grpo, dapo, rloo, reinforce_pp, gspo, cispo, sapo, luspo, "
        "vespo, ppo",
    ):
        load_config(None, ["algorithm.name=ppo2"])
    with pytest.raises(ConfigError, match="kl_in_reward needs algorithm.beta > 0"):
        load_config(None, ["algorithm.name=ppo", "algorithm.beta=0"])


def test_a_section_keeps_its_command_s_own_defaults_for_the_keys_a_recipe_leaves_out():
    from polo.config.finetune import load_dpo_config, load_sft_config

    dpo = load_dpo_config({"data": {"train_path": "x.jsonl"}, "train": {"epochs": 2}, "output": {"progress": False}})
    assert (dpo.train.learning_rate, dpo.train.epochs, dpo.output.dir) == (5e-7, 2, "runs/dpo")  # not the class's 1e-5
    assert load_sft_config({"data": {"train_path": "x.jsonl"}, "output": {"overwrite": True}}).output.dir == "runs/sft"
