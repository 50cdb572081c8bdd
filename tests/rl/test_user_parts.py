"""A user's own task and policy loss, each with options of its own, come in by module:Name and train through
`polo train`; their options are checked like any recipe key and shown by `polo config`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_rl_config
from polo import core
from polo.cli.config import command_sections
from polo.config import ConfigError, load_config

USER_MODULE = '''
"""A user's task (a Task subclass taking its options as arguments), a registered task with a settings dataclass,
and a policy loss with a setting of its own."""
import json
import random
from dataclasses import dataclass
from pathlib import Path

from polo.config import setting
from polo.core import register_policy_loss, register_task, vanilla_pg_loss
from polo.data import Task
from polo.rewards.answers import checker


class Doubling(Task):
    """What is twice N? N drawn from [1, largest]; the task keys num_train and num_eval come from the recipe."""

    def __init__(self, num_train=None, num_eval=None, largest=9, seed=0):
        with Path("task_calls.jsonl").open("a") as log:
            log.write(json.dumps({"num_train": num_train, "num_eval": num_eval, "largest": largest}) + "\\n")
        draw = random.Random(seed)
        rows = [{"question": f"2 * {n}", "answer": str(2 * n)} for n in (draw.randint(1, largest) for _ in range(50))]
        super().__init__("doubling", rows[: num_train or 40], rows[40 : 40 + (num_eval or 10)], checker("exact_number"))


@dataclass
class CountingSettings:
    """Counting problems."""

    upto: int = setting(5, help="the largest number counted to", range=">= 1")


@register_task("counting", settings=CountingSettings, help="count up to a number")
def counting(options, num_eval=None):
    rows = [{"question": f"count to {n}", "answer": str(n)} for n in range(1, options.upto + 1)]
    return Task("counting", rows, rows[: num_eval or 2], checker("exact_number"))


@dataclass
class ScaledSettings:
    """The scaled REINFORCE loss."""

    scale: float = setting(1.0, help="multiplies the loss", range="> 0")


@register_policy_loss("scaled_pg", settings=ScaledSettings, help="REINFORCE, scaled")
def scaled_pg(inputs, settings, options):
    """-scale * A log pi: a loss with a setting of its own, which AlgorithmConfig knows nothing of."""
    with Path("loss_calls.jsonl").open("a") as log:
        log.write(json.dumps({"scale": options.scale, "clip": settings.clip_eps_high}) + "\\n")
    return options.scale * vanilla_pg_loss(inputs.logprobs, inputs.advantages, inputs.mask), {}
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write `my_parts.py` into `tmp_path`, the current directory of the run."""
    (tmp_path / "my_parts.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_parts", None)
    for registry, name in ((core.TASKS, "counting"), (core.POLICY_LOSSES, "scaled_pg")):
        if name in registry:  # the module registered them in this process: later tests see the built-ins alone
            del registry[name]


def polo_train(tmp_path: Path, tiny_model_dir: Path, **sections: dict) -> list[dict]:
    """Run `polo train` in `tmp_path` on the tiny model, `sections` over the tiny recipe; return its metrics rows."""
    recipe = tiny_rl_config(tiny_model_dir, tmp_path / "run", eval={"before": False, "after": False})
    for section, values in sections.items():
        recipe[section].update(values)
    recipe["train"].update({"steps": 2})
    recipe["output"].update({"plots": False, "report_to": []})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    polo = Path(sys.executable).with_name("polo")
    finished = subprocess.run(
        [str(polo), "train", "recipe.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_user_task_from_a_module_with_its_own_options_trains_through_polo_train(tiny_model_dir, user_module):
    task = {"name": "my_parts:Doubling", "num_train": 30, "num_eval": 4, "options": {"largest": 4}}
    rows = polo_train(user_module, tiny_model_dir, task=task)
    calls = [json.loads(line) for line in (user_module / "task_calls.jsonl").read_text().splitlines()]
    assert calls[-1] == {"num_train": 30, "num_eval": 4, "largest": 4}  # the task keys and its own option
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    saved = yaml.safe_load((user_module / "run" / "config.yaml").read_text())
    assert saved["task"]["name"] == "my_parts:Doubling" and saved["task"]["options"] == {"largest": 4}


def test_a_user_policy_loss_with_its_own_option_trains_through_polo_train(tiny_model_dir, user_module):
    algorithm = {"policy_loss": "my_parts:scaled_pg", "policy_loss_options": {"scale": 0.25}}
    rows = polo_train(user_module, tiny_model_dir, algorithm=algorithm)
    calls = [json.loads(line) for line in (user_module / "loss_calls.jsonl").read_text().splitlines()]
    assert len(calls) >= 2 and all(call == {"scale": 0.25, "clip": 0.2} for call in calls)
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]


def test_options_are_checked_like_recipe_keys_and_a_missing_one_is_named(user_module):
    def error(recipe: dict) -> str:
        with pytest.raises(ConfigError) as raised:
            load_config(recipe)
        assert "\n" not in str(raised.value)
        return str(raised.value)

    assert error({"algorithm": {"policy_loss": "my_parts:scaled_pg", "policy_loss_options": {"scale": -1}}}) == (
        "algorithm.policy_loss_options.scale must be a finite number > 0, got -1.0"
    )
    assert error({"algorithm": {"policy_loss": "my_parts:scaled_pg", "policy_loss_options": {"scael": 2}}}) == (
        "unknown config key 'algorithm.policy_loss_options.scael' (did you mean 'scale'?); valid keys in "
        "algorithm.policy_loss_options: scale"
    )
    assert error({"task": {"name": "my_parts:counting", "options": {"upto": 0}}}) == (
        "task.options.upto must be at least 1, got 0"
    )
    assert error({"task": {"name": "my_parts:Doubling", "options": {"biggest": 4}}}) == (
        "task.options.biggest: my_parts:Doubling takes no option 'biggest'; its options: num_train, num_eval, "
        "largest, seed"
    )
    assert load_config({"task": {"name": "my_parts:counting", "options": {"upto": 3}}}).task.options == {"upto": 3}


def test_polo_config_shows_a_registered_entry_s_own_settings(user_module):
    import my_parts  # noqa: F401  (registers its task and its loss)

    sections = {section.key: section for section in command_sections("train")}
    assert sections["task.options"].summary.startswith("(task counting) Counting problems.")
    assert [key.key for key in sections["task.options"].keys] == ["task.options.upto"]
    loss = sections["algorithm.policy_loss_options"]
    assert [(key.key, key.accepts) for key in loss.keys] == [("algorithm.policy_loss_options.scale", "> 0")]


def test_a_user_task_from_a_module_with_its_own_options_evaluates_with_polo_eval(tiny_model_dir, user_module):
    task = {"name": "my_parts:Doubling", "num_eval": 3, "options": {"largest": 4}}
    (user_module / "recipe.yaml").write_text(yaml.safe_dump({"model": {"name": str(tiny_model_dir)}, "task": task}))
    polo = Path(sys.executable).with_name("polo")
    args = ["eval", "--recipe", "recipe.yaml", "--greedy", "--max-new-tokens", "3", "--output", "eval.json"]
    finished = subprocess.run(
        [str(polo), *args, "--no-progress"], cwd=user_module, capture_output=True, text=True, timeout=900
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    calls = [json.loads(line) for line in (user_module / "task_calls.jsonl").read_text().splitlines()]
    assert calls[-1] == {"num_train": None, "num_eval": 3, "largest": 4}  # the task keys and its own option
    result = json.loads((user_module / "eval.json").read_text())
    assert result["settings"]["task"] == "doubling" and result["settings"]["num_problems"] == 3
    references = [problem["reference"] for problem in result["problems"]]
    assert [problem["question"] for problem in result["problems"]] == [f"2 * {int(n) // 2}" for n in references]
    assert all(int(n) // 2 <= 4 for n in references)  # drawn with the recipe's largest=4, not the default 9


def test_polo_evaluate_takes_a_user_task_from_a_module(tiny_model_dir, user_module):
    import polo

    task = {"name": "my_parts:Doubling", "num_eval": 2, "options": {"largest": 3}}
    result = polo.evaluate({"model": {"name": str(tiny_model_dir)}, "task": task}, settings={"greedy": True})
    assert len(result.problems) == 2 and result.settings["task"] == "doubling"
    assert all(int(problem["reference"]) <= 6 for problem in result.problems)
