"""config/ reads every registered name from its registry, and a bad name or a missing key is one line before
anything loads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from test_documented import every_dataclass, root_configs

from polo.cli import main
from polo.cli.config import command_sections
from polo.config import load_config
from polo.config.fields import choice_names
from polo.core import registry as registries
from polo.core.registry import Registry

REGISTRIES = [value for value in vars(registries).values() if isinstance(value, Registry)]


def config_package_fields() -> list[tuple[type, dataclasses.Field]]:
    """Return every field of every command's sections that polo.config declares."""
    seen: set[type] = set()
    for roots in root_configs().values():
        for root in roots:
            every_dataclass(root, seen)
    classes = sorted((cls for cls in seen if cls.__module__.startswith("polo.config.")), key=lambda c: c.__qualname__)
    return [(cls, spec) for cls in classes for spec in dataclasses.fields(cls)]


def typed_names(text: str, registry: Registry) -> list[str]:
    """Return the names of `registry` that `text` writes as words."""
    return [name for name in registry.names() if re.search(rf"(?<![\w.:/-]){re.escape(name)}(?![\w/-])", text)]


def test_no_help_in_config_types_a_registry_s_names_by_hand():
    """A help may describe its own choices (the presets), but never lists a registry's names: they change when an
    entry is registered, and `polo config` shows them, each with its own registered help."""
    fields = config_package_fields()
    assert len(fields) > 100
    for cls, spec in fields:
        own = set(choice_names(spec.metadata["choices"])) if spec.metadata.get("choices") is not None else set()
        tied = {spec.metadata.get(kind) for kind in ("choices", "options_of", "used_by")}
        for registry in REGISTRIES:
            names = [
                name for name in typed_names(spec.metadata["help"], registry) if name not in own or registry in tied
            ]
            where = f"{cls.__qualname__}.{spec.name}'s help names {registry.kind}s {names}"
            assert not (registry in tied and names), where + ": they come from the registry"
            assert len(names) < 2, where + ": a list of them belongs to the registry"


def test_no_choices_in_config_copy_a_registry_s_names():
    for cls, spec in config_package_fields():
        choices = spec.metadata.get("choices")
        if choices is None or isinstance(choices, Registry):
            continue
        names = set(choice_names(choices))
        for registry in REGISTRIES:
            copied = len(names) > 1 and names <= set(registry.names())
            assert not copied, f"{cls.__qualname__}.{spec.name} copies {registry.kind}s {sorted(names)}"


@pytest.mark.parametrize(
    ("key", "registry", "others"),
    [
        ("task.name", registries.TASKS, ["module:name"]),
        ("task.checker", registries.CHECKERS, ["module:name"]),
        ("task.environment.name", registries.ENVIRONMENTS, ["module:name"]),
        ("rewards", registries.REWARDS, ["module:name", "model:PATH"]),
        ("model.name", registries.MODELS, ["a local model directory | org/name[@revision]"]),
        ("sampling.sampler", registries.SAMPLERS, []),
        ("algorithm.policy_loss", registries.POLICY_LOSSES, ["module:name"]),
    ],
)
def test_polo_config_shows_the_registered_names_and_what_each_registered(key, registry, others):
    (shown,) = [entry for section in command_sections("train") for entry in section.keys if entry.key == key]
    assert shown.accepts == " | ".join([*registry.names(), *others])
    for entry in registry.entries():
        assert f"{entry.name}: {entry.help}" in shown.help


def test_a_newly_registered_reward_is_accepted_and_shown_without_touching_config():
    @registries.register_reward("length_bonus", help="one point per hundred characters")
    def length_bonus(completion: str, row: dict) -> float:
        return len(completion) / 100

    try:
        assert load_config(None, ["rewards.length_bonus=0.5"]).rewards == {"length_bonus": 0.5}
        (rewards,) = [
            entry for section in command_sections("train") for entry in section.keys if entry.key == "rewards"
        ]
        assert "length_bonus" in rewards.accepts and "length_bonus: one point per hundred characters" in rewards.help
    finally:
        del registries.REWARDS["length_bonus"]


def test_a_task_key_says_which_registered_tasks_read_it():
    keys = {entry.key: entry for section in command_sections("train") for entry in section.keys}
    assert keys["task.operators"].help.startswith("task arithmetic: ")
    assert keys["task.train_path"].help.startswith("task gsm8k, jsonl: ")
    assert keys["task.path"].help.startswith("task hf: ")  # a field of the hf task's source dataclass


# ---------------------------------------------------------------- one line for a bad name or a missing key


def polo_train_error(tmp_path: Path, monkeypatch, capsys, *overrides: str) -> str:
    """Return what `polo train` prints for a recipe with `overrides`, asserting it is one error line and status 2."""
    (tmp_path / "recipe.yaml").write_text("train: {steps: 1}\noutput: {report_to: []}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "recipe.yaml", *overrides]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("polo: error: "), captured.err
    return lines[0].removeprefix("polo: error: ")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["rewards.corect=1.0"],
            "rewards.corect: 'corect' is not a registered reward (did you mean 'correct'?); registered: ",
        ),
        (
            ["rewards.no_such_rewards:length=1"],
            "rewards.no_such_rewards:length: cannot import module 'no_such_rewards'",
        ),
        (
            ["rewards.my_rewards:lenght=1"],
            "rewards.my_rewards:lenght: module 'my_rewards' has no attribute 'lenght' (did you mean 'length'?)",
        ),
        (["rewards.my_rewards:LIMIT=1"], "rewards.my_rewards:LIMIT: 'my_rewards:LIMIT' is a int, not a function"),
        (
            ["task.name=jsonl"],
            "task.name=jsonl needs task.train_path and task.eval_path, which the recipe leaves unset",
        ),
        (
            ["task.name=gsm8k"],
            "gsm8k: no data: set task.train_path and task.eval_path, or POLO_GSM8K_DIR",
        ),
        (["task.name=arithmatic"], "task.name: 'arithmatic' is not a registered task (did you mean 'arithmetic'?)"),
        (["train.stpes=3"], "unknown config key 'train.stpes' (did you mean 'steps'?); valid keys in train: "),
        (["sampling.sampler=statc"], "sampling.sampler: 'statc' is not a registered sampler (did you mean 'static'?)"),
        (["train.precision=bf61"], "train.precision: 'bf61' is not one of auto, fp32, bf16, bf16_master (did you mean"),
        (
            ["algorithm.policy_loss_options.eps=0.1"],
            "algorithm.policy_loss_options.eps: ppo_clip takes no option 'eps'; its options: none",
        ),
        (["task.name=my_rewards:nothing"], "task.name: module 'my_rewards' has no attribute 'nothing'"),
        (
            ["algorithm.name=vespo", "algorithm.policy_loss_options.lambda_pos=0"],
            "algorithm.policy_loss_options.lambda_pos must be a finite number > 0, got 0.0",
        ),
        (
            ["algorithm.name=vespo", "algorithm.policy_loss_options.k=2"],
            "unknown config key 'algorithm.policy_loss_options.k'",
        ),
    ],
)
def test_a_bad_name_or_a_missing_key_is_one_line_before_anything_loads(
    tmp_path, monkeypatch, capsys, overrides, expected
):
    (tmp_path / "my_rewards.py").write_text("LIMIT = 3\n\ndef length(completion, row):\n    return len(completion)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("POLO_GSM8K_DIR", raising=False)  # gsm8k's data is where this variable points, when set
    assert polo_train_error(tmp_path, monkeypatch, capsys, *overrides).startswith(expected)
