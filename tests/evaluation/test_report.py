"""Tests for polo.evaluation.report on a fake run directory shaped like the trainer's output."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import pytest

from polo.evaluation.report import build_report, pick_steps, running_mean, write_report

CONFIG_YAML = """model:
  name: smollm2-135m-instruct
task:
  name: arithmetic
  answer_in_tags: true
rewards:
  correct: 1.0
  r1_format: 0.2
algorithm:
  name: grpo
  beta: 0.04
train:
  steps: 30
"""


def make_fake_run(run_dir: Path, steps: int = 30, eval_every: int = 10) -> Path:
    """Write config.yaml, metrics.jsonl, eval_step*.json and samples.jsonl as the trainer does."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(CONFIG_YAML)
    rows, samples = [], []

    def evaluate(step: int) -> None:
        accuracy = 0.15 + 0.6 * step / steps
        rows.append(
            {"step": step, "eval/accuracy": accuracy, "eval/completion_length": 20 + step, "eval/truncated": 0.0}
        )
        (run_dir / f"eval_step{step:06d}.json").write_text(
            json.dumps(
                {
                    "accuracy": accuracy,
                    "completion_length": 20.0 + step,
                    "truncated": 0.0,
                    "samples": [
                        {
                            "question": "What is 47 + 38?",
                            "answer": "85",
                            "completion": f"<think>47+38</think> <answer>{85 if step else 84}</answer>",
                            "score": float(step > 0),
                        }
                    ],
                }
            )
        )

    evaluate(0)
    for step in range(1, steps + 1):
        progress = step / steps
        correct = 0.2 + 0.6 * progress + 0.05 * math.sin(step)
        fmt = min(1.0, 0.1 + progress)
        rows.append(
            {
                "step": step,
                "reward/mean": correct + 0.2 * fmt,
                "reward/correct/mean": correct,
                "reward/r1_format/mean": fmt,
                "accuracy": correct,
                "completion_length/mean": 30 + 40 * progress,
                "completion_length/min": 10 + 5 * progress,
                "completion_length/max": 64.0,
                "kl": 0.002 * step,
                "entropy": 1.2 - 0.5 * progress,
                "clip_fraction/low": 0.01,
                "clip_fraction/high": 0.02,
                "loss": 0.01,
                "grad_norm": 0.5 + 0.1 * math.cos(step),
                "time/step": 20.0,
                "time/generation": 5.0,
            }
        )
        prompt = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
        samples.append(
            {
                "step": step,
                "prompt": prompt,
                "completion": f"<think>12 + 30 = 42</think> <answer>42</answer> & step {step}",
                "reward": 1.2,
                "rewards": {"correct": 1.0, "r1_format": 1.0},
                "correct": 1.0,
                "kind": "best",
            }
        )
        samples.append(
            {
                "step": step,
                "prompt": prompt,
                "completion": "<script>alert('x')</script> I think it is 41",
                "reward": 0.0,
                "rewards": {"correct": 0.0, "r1_format": 0.0},
                "correct": 0.0,
                "kind": "worst",
            }
        )
        if step % eval_every == 0:
            evaluate(step)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in samples))
    return run_dir


def embedded_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_report_is_one_self_contained_page(tmp_path):
    page = build_report(make_fake_run(tmp_path / "run"))
    pngs = embedded_pngs(page)
    assert len(pngs) == 7  # accuracy, length, reward per function, KL, entropy, clip fractions, grad norm
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in pngs)
    # nothing to fetch: no external scripts, styles or images
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "<script" not in page


def test_report_escapes_completions_and_shows_best_and_worst(tmp_path):
    page = build_report(make_fake_run(tmp_path / "run"), sample_steps=3)
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "&lt;think&gt;12 + 30 = 42&lt;/think&gt; &lt;answer&gt;42&lt;/answer&gt; &amp; step 1" in page
    assert [int(step) for step in re.findall(r"<h3>Step (\d+)</h3>", page)] == [1, 15, 30]
    assert page.count('class="sample best"') == 3 and page.count('class="sample worst"') == 3


def test_report_shows_config_and_held_out_results(tmp_path):
    page = build_report(make_fake_run(tmp_path / "run"))
    assert "name: smollm2-135m-instruct" in page and "r1_format: 0.2" in page
    assert "0.150 → 0.750" in page  # held-out greedy accuracy, first -> last evaluation
    assert re.search(r"<tr><td>20</td><td>0\.550</td>", page)


def test_report_of_a_run_without_samples_or_metrics(tmp_path):
    run_dir = tmp_path / "bare"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(CONFIG_YAML)
    page = build_report(run_dir)
    assert "No samples.jsonl" in page and "no training rows" in page
    assert embedded_pngs(page) == []


def test_report_rejects_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a polo run directory"):
        build_report(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_report(tmp_path / "missing")


def test_write_report_and_the_command(tmp_path, capsys):
    from polo.cli import main

    run_dir = make_fake_run(tmp_path / "run")
    assert write_report(run_dir) == run_dir / "report.html"
    target = tmp_path / "elsewhere" / "page.html"
    assert main(["report", str(run_dir), "--output", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert target.read_text().startswith("<!DOCTYPE html>")


def test_pick_steps_spreads_and_keeps_the_ends():
    assert pick_steps([1, 2, 3], 4) == [1, 2, 3]
    assert pick_steps(list(range(1, 31)), 4) == [1, 11, 20, 30]
    assert pick_steps(list(range(1, 31)), 1) == [30]
    assert pick_steps([], 3) == [] and pick_steps([1, 2], 0) == []


def test_running_mean_is_trailing():
    assert running_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
