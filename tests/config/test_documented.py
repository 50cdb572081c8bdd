"""The config documents itself: every field of every command carries help, docs/config.md is generated
from that metadata and is current, and `polo config` / `polo train --help KEY` print the same."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from polo import core
from polo.cli import main
from polo.cli.config import RECIPE_COMMANDS, command_sections, describe, reference
from polo.config.fields import choice_names

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def root_configs() -> dict[str, list[type]]:
    from polo.config.finetune import DPOConfig, RewardModelConfig, SFTConfig
    from polo.config.schema import Config
    from polo.control.config import ControlConfig
    from polo.pipeline.recipe import DemoSettings, PipelineRecipe, RejectionSettings

    return {
        "train": [Config],
        "sft": [SFTConfig],
        "rm": [RewardModelConfig],
        "dpo": [DPOConfig],
        "control": [ControlConfig],
        "pipeline": [PipelineRecipe, DemoSettings, RejectionSettings],
    }


def every_dataclass(cls: type, seen: set[type]) -> None:
    """Add `cls` and every dataclass its fields hold (as a section or as list items) to `seen`."""
    if cls in seen:
        return
    seen.add(cls)
    for annotation in typing.get_type_hints(cls).values():
        for candidate in (annotation, *typing.get_args(annotation)):
            if dataclasses.is_dataclass(candidate):
                every_dataclass(candidate, seen)


def test_every_field_of_every_command_has_help():
    seen: set[type] = set()
    for roots in root_configs().values():
        for root in roots:
            every_dataclass(root, seen)
    assert len(seen) >= 27  # every section of every command, OptimizerConfig included
    undocumented = [
        f"{cls.__module__}.{cls.__qualname__}.{spec.name}"
        for cls in seen
        for spec in dataclasses.fields(cls)
        if not str(spec.metadata.get("help", "")).strip()
    ]
    assert undocumented == [], (
        f"fields without help (declare them with polo.config.setting(default, help=...)): {undocumented}"
    )
    fields = sum(len(dataclasses.fields(cls)) for cls in seen)
    assert fields >= 226


def test_docs_config_md_is_generated_from_the_fields_and_current():
    assert DOCS.exists(), "docs/config.md is missing: write it with  polo config --markdown > docs/config.md"
    assert DOCS.read_text() == reference(), (
        "docs/config.md is stale (a config field, its help or a registry changed): regenerate it with\n"
        "    .venv/bin/polo config --markdown > docs/config.md"
    )


def test_docs_list_every_key_of_every_command_with_default_and_help():
    text = DOCS.read_text()
    for command in RECIPE_COMMANDS:
        assert f"## polo {command}\n" in text
        for section in command_sections(command):
            for key in section.keys:
                assert f"| `{key.key}` |" in text and key.help
    assert "| `algorithm.clip_eps_high` | float | `0.2` | >= 0 |" in text and "DAPO" in text
    assert "| `train.learning_rate` | float | `5.0e-07` |" in text  # DPO's own default, read from an instance


@pytest.mark.parametrize(
    ("key", "registry"),
    [
        ("algorithm.advantage_estimator", core.ADVANTAGE_ESTIMATORS),
        ("algorithm.policy_loss", core.POLICY_LOSSES),
        ("algorithm.loss_aggregation", core.LOSS_AGGREGATIONS),
        ("algorithm.kl_estimator", core.KL_ESTIMATORS),
    ],
)
def test_registered_choices_come_from_the_registries(key, registry):
    (section,) = [section for section in command_sections("train") if section.key == "algorithm"]
    (entry,) = [entry for entry in section.keys if entry.key == key]
    assert entry.accepts == " | ".join([*registry.names(), "module:name"])


def test_choices_that_mirror_other_modules_stay_equal():
    from polo.config.schema import TRACKER_PACKAGES
    from polo.control.config import ControlConfig
    from polo.runtime.trackers import SINKS

    assert set(TRACKER_PACKAGES) == set(SINKS)
    (name,) = [spec for spec in dataclasses.fields(ControlConfig().algorithm) if spec.name == "name"]
    assert sorted(choice_names(name.metadata["choices"])) == ["a2c", "grpo", "ppo", "reinforce", "trpo"]


def test_polo_config_prints_a_section_a_key_and_the_index(capsys):
    assert main(["config", "algorithm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("polo train\n[algorithm]") and "algorithm.clip_eps_high: float = 0.2  (>= 0)" in out
    assert "algorithm.lam:" in out and "train.learning_rate" not in out
    assert main(["config", "sft", "train.learning_rate"]) == 0
    out = capsys.readouterr().out
    assert "train.learning_rate: float = 1.0e-05  ([0, 1])" in out and "train.epochs" not in out
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert all(f"polo {command}" in out for command in RECIPE_COMMANDS)
    assert main(["config", "algorithm.nonsense"]) == 2
    assert capsys.readouterr().err.startswith("polo: error: polo train has no key or section 'algorithm.nonsense'")


def test_help_key_of_a_command_prints_that_key(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help", "algorithm.kl_estimator"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out == describe("train", "algorithm.kl_estimator") + "\n" and "Schulman 2020" in out
    with pytest.raises(SystemExit):
        main(["control", "-h", "train.optimizer"])
    assert "train.optimizer: str = adam  (adam | rmsprop)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "answer checkers" in capsys.readouterr().out  # the plain help keeps its epilog
