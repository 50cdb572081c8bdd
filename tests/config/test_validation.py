"""Values of the right type that make no sense: one `ConfigError` line naming the key, the value and what is
accepted."""

from __future__ import annotations

import dataclasses
import re

import pytest

from polo.config import Config, ConfigError, load_config, setting
from polo.config.validation import check_settings


def float_keys(config, prefix: str = "") -> list[str]:
    """Return the dotted key of every float of a config (mapping values too), None-valued optional floats left out."""
    keys = []
    for spec in dataclasses.fields(config):
        key, value = f"{prefix}{spec.name}", getattr(config, spec.name)
        if dataclasses.is_dataclass(value):
            keys += float_keys(value, f"{key}.")
        elif isinstance(value, dict):
            keys += [f"{key}.{name}" for name, item in value.items() if isinstance(item, float)]
        elif isinstance(value, float):
            keys.append(key)
    return keys


def error_of(overrides: list[str], loader=load_config) -> str:
    with pytest.raises(ConfigError) as error:
        loader(None, overrides)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sampling.temperature=nan", "sampling.temperature must be a finite number > 0, got nan"),
        ("sampling.temperature=inf", "sampling.temperature must be a finite number > 0, got inf"),
        ("sampling.temperature=0", "sampling.temperature must be a finite number > 0, got 0.0"),
        ("train.learning_rate=-1e-6", "train.learning_rate must be in [0, 1], got -1e-06"),
        ("train.learning_rate=nan", "train.learning_rate must be in [0, 1], got nan"),
        ("train.learning_rate=10", "train.learning_rate must be in [0, 1], got 10.0"),
        ("algorithm.critic_learning_rate=2", "algorithm.critic_learning_rate must be in [0, 1], got 2.0"),
        ("algorithm.clip_eps_low=5", "algorithm.clip_eps_low must be in [0, 1), got 5.0"),
        ("algorithm.clip_eps_low=1", "algorithm.clip_eps_low must be in [0, 1), got 1.0"),
        ("algorithm.clip_eps_high=-0.1", "algorithm.clip_eps_high must be a finite number >= 0, got -0.1"),
        ("algorithm.clip_delta=1", "algorithm.clip_delta must be a finite number > 1, got 1.0"),
        ("sampling.top_p=1.5", "sampling.top_p must be in (0, 1], got 1.5"),
        ("algorithm.gamma=-inf", "algorithm.gamma must be in [0, 1], got -inf"),
        ("algorithm.value_clip=0", "algorithm.value_clip must be a finite number > 0, got 0.0"),
        ("train.adam_beta2=1", "train.adam_beta2 must be in [0, 1), got 1.0"),
        ("train.max_grad_norm=0", "train.max_grad_norm must be a finite number > 0, got 0.0"),
        ("rewards.correct=nan", "rewards.correct must be a finite number, got nan"),
        ("model.lora.alpha=inf", "model.lora.alpha must be a finite number, got inf"),
    ],
)
def test_floats_must_be_finite_and_in_range(override, expected):
    assert error_of([override]) == expected


def test_the_clip_and_learning_rate_ranges_keep_every_preset_and_the_edges_of_real_runs():
    # GSPO clips within 3e-4 / 4e-4 of 1, CISPO caps its weight at 1 + 4: a range must not reject either
    for name in ("grpo", "dapo", "gspo", "cispo", "sapo", "ppo"):
        load_config(None, [f"algorithm.name={name}"])
    edges = load_config(None, ["algorithm.clip_eps_low=0.99", "algorithm.clip_eps_high=10", "train.learning_rate=1"])
    assert (edges.algorithm.clip_eps_low, edges.algorithm.clip_eps_high, edges.train.learning_rate) == (0.99, 10, 1)


def test_every_float_of_a_run_is_checked_for_nan():
    keys = float_keys(Config())
    assert "sampling.temperature" in keys and "algorithm.lam" in keys and "rewards.correct" in keys
    for key in keys:
        message = error_of([f"{key}=nan"])
        assert message.startswith(f"{key} must be ") and message.endswith("got nan")


def test_an_unset_optional_float_passes():
    assert load_config(None, ["algorithm.value_clip=null"]).algorithm.value_clip is None


def test_range_forms_come_from_the_field_metadata():
    @dataclasses.dataclass
    class Section:
        low: float = setting(0.0, help="h", range="[0, 1)")
        count: int = setting(1, help="h", range=">= 1")
        above: float = setting(1.0, help="h", range="> 0")
        kind: str = setting("a", help="h", choices=("a", "b"))
        sizes: list[int] = setting([1], help="h", range=">= 1")

    check_settings(Section())
    for field_name, value, message in (
        ("low", 1.0, "low must be in [0, 1), got 1.0"),
        ("low", float("nan"), "low must be in [0, 1), got nan"),
        ("count", 0, "count must be at least 1, got 0"),
        ("above", 0.0, "above must be a finite number > 0, got 0.0"),
        ("kind", "c", "kind: 'c' is not one of a, b"),
        ("sizes", [2, 0], "sizes[1] must be at least 1, got 0"),
    ):
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            check_settings(dataclasses.replace(Section(), **{field_name: value}))


def test_a_malformed_range_fails_when_the_field_is_declared():
    with pytest.raises(ValueError, match="is not '> N', '>= N' or an interval"):
        setting(0.0, help="h", range="between 0 and 1")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("output.keep_checkpoints=0", "output.keep_checkpoints must be at least 1, got 0"),
        ("output.keep_checkpoints=-2", "output.keep_checkpoints must be at least 1, got -2"),
        ("eval.batch_size=0", "eval.batch_size must be at least 1, got 0"),
        ("eval.max_new_tokens=0", "eval.max_new_tokens must be at least 1, got 0"),
        ("eval.every=-1", "eval.every must be at least 0, got -1"),
        ("output.save_every=-1", "output.save_every must be at least 0, got -1"),
        ("task.num_eval=-1", "task.num_eval must be at least 0, got -1"),
        ("train.threads=0", "train.threads must be at least 1, got 0"),
        ("train.steps=-1", "train.steps must be at least 0, got -1"),
    ],
)
def test_counts_out_of_range(override, expected):
    assert error_of([override]) == expected


def test_output_dir_that_is_a_file(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    assert (
        error_of([f"output.dir={afile}"])
        == f"output.dir: {afile} is a file, not a directory; name a directory (it is made if missing)"
    )
    assert f"{afile}/run cannot be made, {afile} is a file" in error_of([f"output.dir={afile}/run"])
    assert load_config(None, [f"output.dir={tmp_path}/new/run"]).output.dir == f"{tmp_path}/new/run"
    assert afile.read_text() == "mine"


def test_finetune_configs_check_every_float(tmp_path):
    from polo.config.finetune import load_dpo_config, load_sft_config

    data = [f"data.train_path={tmp_path / 'train.jsonl'}", f"output.dir={tmp_path / 'out'}"]
    assert (
        error_of([*data, "train.learning_rate=nan"], load_sft_config)
        == "train.learning_rate must be in [0, 1], got nan"
    )
    assert (
        error_of([*data, "train.learning_rate=-1"], load_sft_config)
        == "train.learning_rate must be in [0, 1], got -1.0"
    )
    assert error_of([*data, "train.learning_rate=10"], load_dpo_config) == (
        "train.learning_rate must be in [0, 1], got 10.0"
    )
    assert error_of([*data, "train.adam_beta1=inf"], load_sft_config) == "train.adam_beta1 must be in [0, 1), got inf"
    assert error_of([*data, "dpo.beta=inf"], load_dpo_config) == "dpo.beta must be a finite number > 0, got inf"
    assert error_of([*data, "train.threads=0"], load_sft_config) == "train.threads must be at least 1, got 0"
    afile = tmp_path / "afile"
    afile.write_text("")
    assert error_of([data[0], f"output.dir={afile}"], load_sft_config).startswith(f"output.dir: {afile} is a file")


def test_control_config_checks_every_float(tmp_path):
    from polo.control.config import load_control_config

    assert (
        error_of(["train.learning_rate=nan"], load_control_config) == "train.learning_rate must be in [0, 1], got nan"
    )
    assert (
        error_of(["train.value_learning_rate=5"], load_control_config)
        == "train.value_learning_rate must be in (0, 1], got 5.0"
    )
    assert error_of(["algorithm.gamma=0"], load_control_config) == "algorithm.gamma must be in (0, 1], got 0.0"
    assert (
        error_of(["algorithm.target_kl=inf"], load_control_config)
        == "algorithm.target_kl must be a finite number > 0, got inf"
    )
    assert (
        error_of(["env.reward_scale=nan"], load_control_config) == "env.reward_scale must be a finite number, got nan"
    )
    assert (
        error_of(["train.target_return=-inf"], load_control_config)
        == "train.target_return must be a finite number, got -inf"
    )
    afile = tmp_path / "afile"
    afile.write_text("")
    assert error_of([f"output.dir={afile}"], load_control_config).startswith(f"output.dir: {afile} is a file")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algorithm.sampler_correction=token_trunc"],
            "algorithm.sampler_correction: 'token_trunc' is not one of token_truncate, token_mask, sequence_truncate, "
            "sequence_mask (did you mean 'token_truncate'?)",
        ),
        (
            ["algorithm.sampler_correction=token_mask", "algorithm.sampler_correction_min=3"],
            "algorithm.sampler_correction_min (3.0) must be below algorithm.sampler_correction_max (3.0)",
        ),
        (
            ["algorithm.sampler_correction=token_truncate", "algorithm.name=vespo"],
            "algorithm.sampler_correction does not apply to policy_loss vespo, whose kernel would take the weight "
            "inside it; leave it null",
        ),
        (
            ["algorithm.sampler_correction_max=0"],
            "algorithm.sampler_correction_max must be a finite number > 0, got 0.0",
        ),
        (
            ["algorithm.off_policy_mask_threshold=-0.1"],
            "algorithm.off_policy_mask_threshold must be a finite number >= 0, got -0.1",
        ),
    ],
)
def test_the_sampler_correction_and_the_off_policy_mask_are_checked(overrides, expected):
    assert error_of(overrides) == expected
