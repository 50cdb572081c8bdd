"""Learning curves of a control run as PNG files: episode return and update diagnostics."""

from __future__ import annotations

from pathlib import Path

from polo.evaluation.plots import _save, _series
from polo.runtime.metrics import read_metrics

DIAGNOSTICS = ("loss/policy", "loss/value", "entropy", "approx_kl", "clip_fraction", "explained_variance", "kl")


def plot_control_run(output_dir: str | Path) -> list[Path]:
    """Write return.png and diagnostics.png from `<output_dir>/metrics.jsonl`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    rows = [row for row in read_metrics(output_dir / "metrics.jsonl") if "episode_return/recent" in row]
    if not rows:
        return []
    written = []
    figure, axis = plt.subplots(figsize=(7, 4))
    steps, values = _series(rows, "episode_return/mean")
    axis.plot(steps, values, alpha=0.4, label="episodes ended in the update")
    steps, values = _series(rows, "episode_return/recent")
    axis.plot(steps, values, linewidth=2, label="mean of the last 20 episodes")
    axis.set(xlabel="environment steps", ylabel="episode return", title="Episode return")
    axis.grid(alpha=0.3)
    axis.legend()
    written.append(_save(figure, output_dir / "return.png"))

    keys = [key for key in DIAGNOSTICS if any(row.get(key) is not None for row in rows)]
    if keys:
        figure, axes = plt.subplots(len(keys), 1, figsize=(7, 1.8 * len(keys)), sharex=True, squeeze=False)
        for axis, key in zip(axes[:, 0], keys):
            steps, values = _series(rows, key)
            axis.plot(steps, values)
            axis.set_ylabel(key, fontsize=8)
            axis.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("environment steps")
        written.append(_save(figure, output_dir / "diagnostics.png"))
    return written
