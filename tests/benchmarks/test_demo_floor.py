"""benchmarks/demo_floor.py: the floor's FLOPs per token and a run's metrics, read without timing anything."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def demo_floor(load_benchmark):
    return load_benchmark("demo_floor")


def test_the_floor_counts_sampling_each_update_epoch_and_a_reference_only_with_beta(demo_floor):
    assert demo_floor.floor_multiplier({"algorithm": {"beta": 0.0}}) == 8  # the demo: sample + one update
    assert demo_floor.floor_multiplier({"algorithm": {"beta": 0.04}}) == 10  # grpo_vs_trl's 10*N*T
    assert demo_floor.floor_multiplier({"algorithm": {"beta": 0.04, "update_epochs": 2}}) == 16
    assert demo_floor.floor_multiplier({}) == 8


def test_step_rows_keeps_the_training_steps_and_names_a_malformed_line(demo_floor, tmp_path):
    rows = [{"step": 0, "accuracy": 0.1}, {"step": 1, "time/step": 4.0, "floor_tokens": 1500.0}]
    rows.append({"step": 2, "time/step": 3.0, "floor_tokens": 1400.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [row["step"] for row in demo_floor.step_rows(tmp_path)] == [1, 2]

    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[1]) + "\n{not json\n")
    with pytest.raises(SystemExit, match="line 2 is not JSON"):
        demo_floor.step_rows(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(SystemExit, match="holds 1 step"):
        demo_floor.step_rows(tmp_path)
    with pytest.raises(SystemExit, match="does not exist"):
        demo_floor.step_rows(tmp_path / "missing")


def test_a_run_without_a_model_or_a_negative_wait_is_one_line_before_anything_is_timed(demo_floor, tmp_path):
    (tmp_path / "config.yaml").write_text("train: {steps: 3}\n")
    with pytest.raises(SystemExit, match="names no model.name"):
        demo_floor.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="--max-wait must be 0 or more"):
        demo_floor.main([str(tmp_path), "--max-wait", "-1"])
    (tmp_path / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(SystemExit, match="is not YAML"):
        demo_floor.main([str(tmp_path)])
