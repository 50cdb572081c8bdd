"""Training curves as PNG files: reward, accuracy and completion length against step (and R1's three panels)."""

from __future__ import annotations

from pathlib import Path

from polo.runtime.metrics import read_metrics


class PlotError(ValueError):
    """A directory that holds no training curves to draw."""


def check_plottable(output_dir: str | Path) -> Path:
    """Return `<output_dir>/metrics.jsonl`, or raise `PlotError` saying why there is nothing to plot there.

    `plot_run` itself draws nothing without complaint (a run of 0 steps has no curves); this is
    for a person who asked for plots and must hear why none came.
    """
    output_dir = Path(output_dir)
    metrics = output_dir / "metrics.jsonl"
    if not output_dir.exists():
        raise PlotError(f"run directory {output_dir} does not exist")
    if not output_dir.is_dir():
        raise PlotError(f"{output_dir} is a file, not a run directory")
    if not metrics.is_file():
        raise PlotError(f"{output_dir} has no metrics.jsonl: not a polo run directory, or the run logged nothing yet")
    try:
        rows = read_metrics(metrics)
    except (ValueError, OSError) as error:
        raise PlotError(f"cannot read {metrics}: {error}") from None
    if not any("reward/mean" in row for row in rows):
        raise PlotError(f"{metrics} holds no training steps to plot")
    return metrics


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


# A series with fewer points than this draws a marker at each: a line alone leaves one point invisible, and a
# short run's few points are its data. Longer series are lines only, as markers would hide their shape.
MARKED_BELOW = 30


def _line(axis, steps: list, values: list, style: str = "-", **options) -> None:
    """Plot a series on `axis` in `style`, with a marker at each point where it has fewer than `MARKED_BELOW`."""
    if len(steps) < MARKED_BELOW and not any(mark in style for mark in "o.sx^"):
        options = {"marker": "o", "markersize": 3, **options}
    axis.plot(steps, values, style, **options)


def plot_run(output_dir: str | Path) -> list[Path]:
    """Return the paths of reward.png, accuracy.png and length.png (and r1.png with an r1_format reward), written
    from `<output_dir>/metrics.jsonl`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    rows = read_metrics(output_dir / "metrics.jsonl")
    train_rows = [row for row in rows if "reward/mean" in row]
    if not train_rows:
        return []
    written = []

    figure, axis = plt.subplots(figsize=(7, 4))
    steps, values = _series(train_rows, "reward/mean")
    _line(axis, steps, values, label="total reward", linewidth=2)
    for key in sorted(
        k for k in train_rows[-1] if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2
    ):
        steps, values = _series(train_rows, key)
        _line(axis, steps, values, label=key.split("/")[1], alpha=0.7)
    axis.set(xlabel="step", ylabel="reward (mean over batch)", title="Reward")
    axis.grid(alpha=0.3)
    axis.legend()
    written.append(_save(figure, output_dir / "reward.png"))

    figure, axis = plt.subplots(figsize=(7, 4))
    steps, values = _series(train_rows, "accuracy")
    _line(axis, steps, values, label="train (sampled)", alpha=0.8)
    steps, values = _series(rows, "eval/accuracy")
    if steps:
        axis.plot(steps, values, "o-", label="held-out (greedy)", linewidth=2)
    axis.set(xlabel="step", ylabel="accuracy", title="Accuracy", ylim=(-0.02, 1.02))
    axis.grid(alpha=0.3)
    axis.legend()
    written.append(_save(figure, output_dir / "accuracy.png"))

    figure, axis = plt.subplots(figsize=(7, 4))
    steps, mean = _series(train_rows, "completion_length/mean")
    _, low = _series(train_rows, "completion_length/min")
    _, high = _series(train_rows, "completion_length/max")
    axis.fill_between(steps, low, high, alpha=0.2, label="min-max")
    _line(axis, steps, mean, label="mean", linewidth=2)
    axis.set(xlabel="step", ylabel="tokens", title="Completion length")
    axis.grid(alpha=0.3)
    axis.legend()
    written.append(_save(figure, output_dir / "length.png"))
    if any(R1_FORMAT_KEY in row for row in train_rows):
        written.append(plot_r1(rows, output_dir / "r1.png"))
    if any("tool/calls_per_episode" in row for row in train_rows):
        written.append(plot_tools(rows, output_dir / "tools.png"))
    return written


def plot_tools(rows: list[dict], path: Path) -> Path:
    """Write a multi-turn run's accuracy and tool use against step to `path` (tools.png) and return it."""
    import matplotlib.pyplot as plt

    train_rows = [row for row in rows if "reward/mean" in row]
    figure, (accuracy, calls) = plt.subplots(1, 2, figsize=(11, 4))
    for axis, panel in ((accuracy, TOOL_ACCURACY), (calls, TOOL_USE)):
        for key, label, style in panel:
            steps, values = _series(rows if key.startswith("eval/") else train_rows, key)
            if steps:
                _line(axis, steps, values, style, label=label, linewidth=2 if key.startswith("eval/") else 1.2)
        axis.set(xlabel="step", ylim=(-0.02, None if panel is TOOL_USE else 1.02))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    accuracy.set(title="Accuracy", ylabel="accuracy")
    calls.set(title="Tool use", ylabel="per episode / rate")
    return _save(figure, path)


TOOL_ACCURACY = (("accuracy", "train (sampled)", "-"), ("eval/accuracy", "held-out (greedy)", "o-"))
TOOL_USE = (
    ("tool/calls_per_episode", "calls per episode (sampled)", "-"),
    ("eval/tool/calls_per_episode", "calls per episode (held-out, greedy)", "o-"),
    ("tool/call_success_rate", "call success rate", "--"),
    ("tool/used_by_correct", "correct answers that called", ":"),
)


# DeepSeek-R1's pictures of a run: held-out accuracy, the format rate and the response length
# against step (length growing with accuracy is the R1-Zero signature).
R1_FORMAT_KEY = "reward/r1_format/mean"
R1_PANELS = (
    ("held-out accuracy", "accuracy"),
    ("r1_format rate (sampled)", "fraction of completions"),
    ("mean response length (sampled)", "tokens"),
)


def draw_r1_panels(axes, rows: list[dict]) -> None:
    """Draw the three R1 panels of a run's metrics rows on three axes (accuracy, r1_format rate, length)."""
    train_rows = [row for row in rows if "reward/mean" in row]
    accuracy, form, length = axes
    steps, values = _series(rows, "eval/accuracy")
    if steps:
        accuracy.plot(steps, values, "o-", color="#dd8452", linewidth=2, label="held-out (greedy)")
    steps, values = _series(train_rows, "accuracy")
    _line(accuracy, steps, values, color="#4c72b0", alpha=0.6, label="train (sampled)")
    accuracy.set_ylim(-0.02, 1.02)
    steps, values = _series(train_rows, R1_FORMAT_KEY)
    _line(form, steps, values, color="#55a868", linewidth=2)
    form.set_ylim(-0.02, 1.02)
    steps, values = _series(train_rows, "completion_length/mean")
    _line(length, steps, values, color="#8172b3", linewidth=2)
    for axis, (title, ylabel) in zip(axes, R1_PANELS):
        axis.set(title=title, ylabel=ylabel)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    if accuracy.get_legend_handles_labels()[0]:
        accuracy.legend(fontsize=8)


def plot_r1(rows: list[dict], path: Path) -> Path:
    """Write the three R1 panels of a run's metrics rows to `path` (r1.png) and return it."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    draw_r1_panels(axes, rows)
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path
