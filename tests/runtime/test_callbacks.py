"""Callbacks: EarlyStopping's patience and modes, and a recipe's `module:Name` built with its options."""

from __future__ import annotations

import pytest

from polo.config import ConfigError
from polo.runtime.callbacks import Callback, EarlyStopping, make_callback


def test_early_stopping_waits_patience_evaluations_without_an_improvement_above_min_delta():
    stopper = EarlyStopping(metric="loss", patience=2, min_delta=0.1, mode="min")
    assert stopper.on_evaluate(0, {"step": 0, "eval/loss": 2.0}) is None  # the first sets the best
    assert stopper.on_evaluate(2, {"step": 2, "eval/loss": 1.5}) is None  # better by more than min_delta
    assert stopper.on_evaluate(4, {"step": 4, "eval/loss": 1.45}) is None  # better, but by less: one waited
    reason = stopper.on_evaluate(6, {"step": 6, "eval/loss": 1.7})
    assert reason == "early stopping: loss 1.7 did not improve on 1.5 by more than 0.1 (min) in 2 evaluations"


def test_early_stopping_in_max_mode_resets_its_patience_on_an_improvement():
    stopper = EarlyStopping(metric="eval/accuracy", patience=2, mode="max")
    for step, accuracy in enumerate([0.2, 0.1, 0.3, 0.3]):
        assert stopper.on_evaluate(step, {"eval/accuracy": accuracy}) is None
    assert stopper.on_evaluate(4, {"eval/accuracy": 0.25}) is not None


def test_early_stopping_names_the_row_keys_when_its_metric_is_missing():
    with pytest.raises(ConfigError, match=r"metric 'eval/acc' is not in the evaluation row; it has: eval/loss$"):
        EarlyStopping(metric="eval/acc").on_evaluate(0, {"step": 0, "eval/loss": 1.0})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "maximum"}, "mode 'maximum' is not one of min, max"),
        ({"patience": 0}, "patience must be an integer >= 1, got 0"),
        ({"min_delta": -1}, "min_delta must be a finite number >= 0, got -1"),
    ],
)
def test_early_stopping_refuses_bad_options_in_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        make_callback("EarlyStopping", options)


def test_a_recipe_callback_is_polos_own_class_or_a_users_module_name(tmp_path, monkeypatch):
    (tmp_path / "my_callbacks.py").write_text(
        "from polo.runtime.callbacks import Callback\n\n"
        "class Every(Callback):\n"
        "    def __init__(self, steps=1):\n"
        "        self.steps = steps\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    built = make_callback("my_callbacks:Every", {"steps": 3})
    assert isinstance(built, Callback) and built.steps == 3
    assert make_callback("EarlyStopping", {"patience": 4}).patience == 4
    with pytest.raises(ConfigError, match=r"output.callbacks: polo has no callback class 'Early'"):
        make_callback("Early")
    with pytest.raises(ConfigError, match=r"module 'my_callbacks' has no callback class 'Missing'"):
        make_callback("my_callbacks:Missing")
    with pytest.raises(ConfigError, match=r"my_callbacks:Every does not take these options \['step'\]"):
        make_callback("my_callbacks:Every", {"step": 3})
