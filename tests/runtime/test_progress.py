"""A run's progress: a bar on a terminal; in a log file one line a step, nothing glued to a bar, and no library bars."""

from __future__ import annotations

import io

import pytest

from polo.runtime import metrics
from polo.runtime.metrics import MetricsLogger


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_three_steps(tmp_path, monkeypatch, stderr) -> MetricsLogger:
    monkeypatch.setattr("sys.stderr", stderr)
    logger = MetricsLogger(tmp_path, 3, progress=True, trackers=metrics.Trackers(report_to=[]))
    for step in (1, 2, 3):
        logger.log({"step": step, "reward/mean": step / 4})
        logger.advance(step, {"reward": step / 4, "accuracy": 0.5})
        logger.write(f"polo: a line of the run at step {step}")
    logger.close()
    return logger


def test_without_a_terminal_each_step_is_one_line_and_nothing_redraws(tmp_path, monkeypatch, capsys):
    log = io.StringIO()
    run_three_steps(tmp_path, monkeypatch, log)
    assert log.getvalue().splitlines() == [
        "polo: step 1/3 reward=0.25 accuracy=0.5",
        "polo: step 2/3 reward=0.5 accuracy=0.5",
        "polo: step 3/3 reward=0.75 accuracy=0.5",
    ]
    assert "\r" not in log.getvalue()
    assert capsys.readouterr().out.splitlines() == [f"polo: a line of the run at step {step}" for step in (1, 2, 3)]


def test_on_a_terminal_the_bar_draws_and_the_runs_lines_go_above_it(tmp_path, monkeypatch, capsys):
    terminal = Terminal()
    monkeypatch.setattr(metrics, "quiet_library_bars", lambda: pytest.fail("a terminal keeps the library bars"))
    run_three_steps(tmp_path, monkeypatch, terminal)
    assert "\r" in terminal.getvalue() and "3/3" in terminal.getvalue()
    assert "polo: step 1/3" not in terminal.getvalue()


def test_without_a_terminal_the_transformers_bars_are_off(tmp_path, monkeypatch):
    from transformers.utils import logging

    monkeypatch.setattr(logging, "_tqdm_active", True)
    run_three_steps(tmp_path, monkeypatch, io.StringIO())
    assert not logging.is_progress_bar_enabled()  # no "Loading weights" / "Writing model shards" at each checkpoint
