"""A run's curves: a short run's points are drawn (markers), a long run's are lines."""

from __future__ import annotations

import json

from polo.evaluation import plots


def written_figures(tmp_path, monkeypatch, steps: int) -> dict:
    """Return {file name: figure} of `plot_run` over a run of `steps` training rows, the figures kept open."""
    rows = [
        {"step": step, "reward/mean": step / 10, "reward/correct/mean": step / 10, "accuracy": 0.5}
        | {"completion_length/mean": 5.0, "completion_length/min": 2, "completion_length/max": 8}
        for step in range(1, steps + 1)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    figures = {}
    monkeypatch.setattr(plots, "_save", lambda figure, path: figures.setdefault(path.name, figure) and path)
    plots.plot_run(tmp_path)
    return figures


def markers(figure) -> set[str]:
    return {line.get_marker() for axis in figure.axes for line in axis.lines}


def test_a_run_of_one_step_draws_its_points(tmp_path, monkeypatch):
    figures = written_figures(tmp_path, monkeypatch, 1)
    assert set(figures) == {"reward.png", "accuracy.png", "length.png"}
    for name, figure in figures.items():
        assert markers(figure) == {"o"}, name  # a single point on a line without markers is invisible


def test_a_long_run_draws_lines(tmp_path, monkeypatch):
    figures = written_figures(tmp_path, monkeypatch, plots.MARKED_BELOW)
    for name, figure in figures.items():
        assert markers(figure) == {"None"}, name
