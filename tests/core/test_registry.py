"""The one registry mechanism: every pluggable kind is a `Registry`, read lazily, with the closest name suggested."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from polo.core import registry as registries
from polo.core.registry import Registry, did_you_mean

EVERY_KIND = {
    "ADVANTAGE_ESTIMATORS": {"grpo", "rloo", "reinforce_pp", "gae"},
    "POLICY_LOSSES": {"ppo_clip", "gspo"},
    "LOSS_AGGREGATIONS": {"seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "micro_batch_token_mean"},
    "KL_ESTIMATORS": {"k1", "k2", "k3"},
    "TASKS": {"arithmetic", "code", "gsm8k", "jsonl", "hf"},
    "REWARDS": {"correct", "code", "code_fraction", "r1_format", "tag_count"},
    "CHECKERS": {"math_verify", "exact_number", "exact_string"},
    "MODELS": {"smollm2-135m-instruct", "gemma3-270m"},
    "SAMPLERS": {"auto", "kv_cache", "static"},
    "ENVIRONMENTS": {"one_turn", "python_tool"},
    "CONTROL_ALGORITHMS": {"reinforce", "a2c", "trpo", "ppo", "grpo"},
}


@pytest.mark.parametrize("kind", sorted(EVERY_KIND))
def test_every_pluggable_kind_is_one_registry_holding_its_built_ins(kind):
    registry = getattr(registries, kind)
    assert isinstance(registry, Registry)
    assert EVERY_KIND[kind] <= set(registry.names())
    assert all(entry.help for entry in registry.entries()), f"{kind}: a built-in without help"


def test_the_older_names_are_the_registries_themselves():
    from polo.control import ALGORITHMS
    from polo.data import TASKS
    from polo.data.environments import ENVIRONMENTS
    from polo.models.loading import BUILTIN_MODELS
    from polo.rewards import BUILTIN_REWARDS, CHECKERS

    assert TASKS is registries.TASKS and BUILTIN_REWARDS is registries.REWARDS and CHECKERS is registries.CHECKERS
    assert BUILTIN_MODELS is registries.MODELS and ENVIRONMENTS is registries.ENVIRONMENTS
    assert ALGORITHMS is registries.CONTROL_ALGORITHMS
    assert registries.COMMANDS.kind == "command"  # filled by the command line's modules


def test_a_home_package_is_imported_the_first_time_the_registry_is_read(tmp_path, monkeypatch):
    (tmp_path / "lazy_home.py").write_text(
        "from tests_registry_under_test import REGISTRY\nREGISTRY.register('built_in', help='x')(len)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("widget", home="lazy_home")
    module = type(sys)("tests_registry_under_test")
    module.REGISTRY = registry
    monkeypatch.setitem(sys.modules, "tests_registry_under_test", module)
    assert "lazy_home" not in sys.modules  # declaring the registry imports nothing
    assert registry.names() == ["built_in"] and registry["built_in"] is len
    monkeypatch.delitem(sys.modules, "lazy_home")


def test_an_unknown_name_gets_the_closest_one_and_every_registered_one():
    registry = Registry("gadget")
    for name in ("correct", "r1_format", "tag_count"):
        registry.register(name)(print)
    with pytest.raises(ValueError) as error:
        registry.entry("corect")
    assert str(error.value) == (
        "'corect' is not a registered gadget (did you mean 'correct'?); registered: correct, r1_format, tag_count "
        "(or module:name for your own)"
    )
    assert did_you_mean("zzz", registry) == ""


def test_a_registry_without_user_entries_takes_names_verbatim():
    models = Registry("built-in model", user_entries=False)
    models.register("tiny")(object())
    assert "tiny" in models and "somewhere:tiny" not in models  # a path with a colon is not the built-in
    assert "module:name" not in models.unknown("tinny") and "did you mean 'tiny'" in models.unknown("tinny")


def test_an_entry_keeps_its_settings_and_help_and_reads_like_a_mapping():
    @dataclass
    class Scale:
        factor: float = 2.0

    registry = Registry("loss")
    registry.register("scaled", settings=Scale, help="a scaled loss")(abs)
    entry = registry.entry("my_module:scaled")
    assert (entry.value, entry.function, entry.settings, entry.help) == (abs, abs, Scale, "a scaled loss")
    registry["plain"] = min
    assert registry.get("plain") is min and registry.get("missing") is None and len(registry) == 2
    del registry["plain"]
    assert list(registry) == ["scaled"]
    with pytest.raises(ValueError, match="needs a non-empty name without ':'"):
        registry.register("a:b")
