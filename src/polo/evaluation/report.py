"""A run report: one self-contained HTML page with the config, the training curves and samples.

Reads what the trainer writes into a run directory: `config.yaml`, `metrics.jsonl` (one row per
step, plus held-out evaluation rows), `eval_stepNNNNNN.json` (greedy held-out results) and
`samples.jsonl` (the best and worst completion of each step). Every file is optional except
that at least one of config and metrics must exist. Figures are PNGs drawn with matplotlib and
embedded as base64 data, so the page is a single file that opens anywhere, offline.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path

from polo.runtime.metrics import read_metrics

EVAL_FILE = re.compile(r"eval_step(\d+)\.json$")
COLORS = {"train": "#4c72b0", "eval": "#dd8452", "band": "#4c72b0"}

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1180px;
       padding: 1.5em 2em 4em; color: #1d1d1f; background: #fafafa; line-height: 1.45; }
h1 { margin-bottom: 0.1em; } h1 small { font-weight: normal; color: #666; font-size: 0.55em; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
.facts { display: flex; flex-wrap: wrap; gap: 0.6em; margin: 1em 0; }
.fact { background: white; border: 1px solid #e2e2e2; border-radius: 6px; padding: 0.5em 0.9em; }
.fact b { display: block; font-size: 1.25em; }
.fact span { color: #666; font-size: 0.85em; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 1em; }
.figures img { width: 100%; background: white; border: 1px solid #e2e2e2; border-radius: 6px; }
pre { background: white; border: 1px solid #e2e2e2; border-radius: 6px; padding: 0.7em 0.9em;
      white-space: pre-wrap; word-break: break-word; font-size: 0.85em; margin: 0.3em 0; }
table { border-collapse: collapse; background: white; font-size: 0.9em; }
td, th { border: 1px solid #e2e2e2; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
.step { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; margin-bottom: 1.2em; }
.sample { background: white; border: 1px solid #e2e2e2; border-radius: 6px; padding: 0.6em 0.9em; min-width: 0; }
.sample.best { border-left: 5px solid #55a868; } .sample.worst { border-left: 5px solid #c44e52; }
.sample h4 { margin: 0 0 0.3em; } .meta { color: #555; font-size: 0.85em; }
details summary { cursor: pointer; color: #555; font-size: 0.85em; }
.note { color: #666; font-style: italic; }
"""


# ---------------------------------------------------------------- reading a run


def read_eval_files(run_dir: Path) -> list[tuple[int, dict]]:
    """Return `(step, result)` for every `eval_stepNNNNNN.json` in the run, by step."""
    results = []
    for path in run_dir.glob("eval_step*.json"):
        match = EVAL_FILE.search(path.name)
        if match:
            results.append((int(match.group(1)), json.loads(path.read_text())))
    return sorted(results, key=lambda item: item[0])


def read_samples(run_dir: Path) -> list[dict]:
    """Return the rows of `samples.jsonl` (empty when the run has none)."""
    return read_metrics(run_dir / "samples.jsonl")  # same format: one JSON object per line


def pick_steps(steps: list[int], count: int) -> list[int]:
    """Return up to `count` of the sorted `steps`, evenly spread and always with the first and last."""
    if count <= 0 or not steps:
        return []
    if len(steps) <= count:
        return steps
    if count == 1:
        return [steps[-1]]
    positions = sorted({round(index * (len(steps) - 1) / (count - 1)) for index in range(count)})
    return [steps[position] for position in positions]


# ---------------------------------------------------------------- figures


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Return `(steps, values)` of the rows that hold a finite `key`."""
    points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float)) and "step" in row]
    return [step for step, _ in points], [value for _, value in points]


def running_mean(values: list[float], window: int) -> list[float]:
    """Return the trailing mean over `window` values at each position (shorter at the start)."""
    means, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        means.append(total / min(index + 1, window))
    return means


def plot_noisy(axis, steps: list[float], values: list[float], label: str, color: str | None = None) -> None:
    """Plot a per-step series thinly, with a trailing running mean on top when it is long."""
    if len(values) < 12:
        axis.plot(steps, values, "o-" if len(values) < 3 else "-", label=label, color=color, linewidth=2, markersize=4)
        return
    window = max(3, len(values) // 12)
    line = axis.plot(steps, values, alpha=0.3, color=color, linewidth=1)[0]
    axis.plot(
        steps, running_mean(values, window), color=line.get_color(), linewidth=2, label=f"{label} ({window}-step mean)"
    )


def figure_png(figure) -> str:
    """Return a matplotlib figure as base64-encoded PNG."""
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def new_figure():
    """Return `(figure, axis)` without touching pyplot's global state."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 3.8))
    return figure, figure.subplots()


def finish(axis, title: str, ylabel: str) -> None:
    axis.set(xlabel="RL step", ylabel=ylabel, title=title)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)


def accuracy_figure(train_rows: list[dict], eval_rows: list[dict]) -> str | None:
    steps, values = series(train_rows, "accuracy")
    eval_steps, eval_values = series(eval_rows, "eval/accuracy")
    if not steps and not eval_steps:
        return None
    figure, axis = new_figure()
    if steps:
        plot_noisy(axis, steps, values, "train (sampled)", COLORS["train"])
    if eval_steps:
        axis.plot(eval_steps, eval_values, "o-", color=COLORS["eval"], linewidth=2, label="held-out (greedy)")
    axis.set_ylim(-0.02, 1.02)
    finish(axis, "Accuracy", "accuracy")
    return figure_png(figure)


def length_figure(train_rows: list[dict], eval_rows: list[dict]) -> str | None:
    steps, mean = series(train_rows, "completion_length/mean")
    if not steps:
        return None
    figure, axis = new_figure()
    _, low = series(train_rows, "completion_length/min")
    _, high = series(train_rows, "completion_length/max")
    if len(low) == len(high) == len(steps):
        axis.fill_between(steps, low, high, alpha=0.15, color=COLORS["band"], label="min–max")
    plot_noisy(axis, steps, mean, "mean (sampled)", COLORS["train"])
    eval_steps, eval_values = series(eval_rows, "eval/completion_length")
    if eval_steps:
        axis.plot(eval_steps, eval_values, "o-", color=COLORS["eval"], linewidth=2, label="held-out (greedy)")
    finish(axis, "Mean response length", "tokens")
    return figure_png(figure)


def reward_figure(train_rows: list[dict]) -> str | None:
    steps, total = series(train_rows, "reward/mean")
    if not steps:
        return None
    names = sorted(
        {
            key.split("/")[1]
            for row in train_rows
            for key in row
            if key.startswith("reward/") and key.endswith("/mean") and key.count("/") == 2
        }
    )
    figure, axis = new_figure()
    plot_noisy(axis, steps, total, "total (weighted)", "black")
    for name in names:
        name_steps, values = series(train_rows, f"reward/{name}/mean")
        plot_noisy(axis, name_steps, values, name)
    finish(axis, "Reward per function", "mean reward over the batch")
    return figure_png(figure)


def kl_figure(train_rows: list[dict]) -> str | None:
    if not train_rows:
        return None
    steps, kl = series(train_rows, "kl")
    figure, axis = new_figure()
    if steps:
        plot_noisy(axis, steps, kl, "KL to the reference", "#8172b3")
    else:
        axis.text(
            0.5,
            0.5,
            "no KL logged\n(β = 0: no reference model)",
            ha="center",
            va="center",
            transform=axis.transAxes,
            color="#666",
        )
        axis.set_xticks([])
        axis.set_yticks([])
    finish(axis, "KL(policy ‖ reference)", "per token")
    return figure_png(figure)


def single_series_figure(train_rows: list[dict], keys: dict[str, str], title: str, ylabel: str) -> str | None:
    """Return a figure of the series `keys` (metric key -> label), or None when none was logged."""
    present = {key: label for key, label in keys.items() if series(train_rows, key)[0]}
    if not present:
        return None
    figure, axis = new_figure()
    for key, label in present.items():
        plot_noisy(axis, *series(train_rows, key), label)
    finish(axis, title, ylabel)
    return figure_png(figure)


# The tool-use curves of a run whose task has an environment (docs/tools.md); absent for one-turn runs.
TOOL_SERIES = {
    "tool/calls_per_episode": "calls per episode (sampled)",
    "eval/tool/calls_per_episode": "calls per episode (held-out, greedy)",
    "tool/call_success_rate": "call success rate",
    "tool/used_by_correct": "share of correct answers that called",
}


# ---------------------------------------------------------------- HTML pieces


def escape(value: object) -> str:
    return html.escape(str(value), quote=True)


def number(value: object, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else escape(value)


def facts_html(config_text: str | None, train_rows: list[dict], evals: list[tuple[int, dict]]) -> str:
    """Return the boxes at the top: model, algorithm, task, steps, held-out accuracy, time."""
    import yaml

    config = {}
    if config_text:
        try:
            config = yaml.safe_load(config_text) or {}
        except yaml.YAMLError:
            config = {}
    section = lambda name: config.get(name) if isinstance(config.get(name), dict) else {}  # noqa: E731
    facts = []
    if section("model").get("name"):
        facts.append(("model", section("model")["name"]))
    if section("algorithm").get("name"):
        facts.append(("algorithm", section("algorithm")["name"]))
    if section("task").get("name"):
        facts.append(("task", section("task")["name"]))
    if train_rows:
        facts.append(("steps logged", str(max(row["step"] for row in train_rows))))
        last = train_rows[-1]
        if isinstance(last.get("accuracy"), (int, float)):
            facts.append(("last-step sampled accuracy", f"{last['accuracy']:.3f}"))
    if evals:
        first, last_eval = evals[0], evals[-1]
        text = f"{first[1].get('accuracy', float('nan')):.3f}"
        if len(evals) > 1:
            text += f" → {last_eval[1].get('accuracy', float('nan')):.3f}"
        facts.append(
            (f"held-out greedy accuracy (step {first[0]}" + (f" → {last_eval[0]})" if len(evals) > 1 else ")"), text)
        )
    seconds = sum(row.get("time/step", 0.0) or 0.0 for row in train_rows)
    if seconds:
        facts.append(("training time", f"{seconds / 60:.1f} min"))
    boxes = "".join(
        f'<div class="fact"><b>{escape(value)}</b><span>{escape(label)}</span></div>' for label, value in facts
    )
    return f'<div class="facts">{boxes}</div>'


def sample_card(sample: dict) -> str:
    kind = sample.get("kind", "")
    rewards = sample.get("rewards") or {}
    reward_text = ", ".join(f"{escape(name)} {number(value, 2)}" for name, value in rewards.items())
    meta = f"reward {number(sample.get('reward'), 3)}"
    if reward_text:
        meta += f" ({reward_text})"
    if sample.get("correct") is not None:
        meta += f" · correct {number(sample.get('correct'), 0)}"
    css = kind if kind in ("best", "worst") else ""
    return (
        f'<div class="sample {css}"><h4>{escape(kind or "sample")}</h4><div class="meta">{meta}</div>'
        f"<details><summary>prompt</summary><pre>{escape(sample.get('prompt', ''))}</pre></details>"
        f"<pre>{escape(sample.get('completion', ''))}</pre></div>"
    )


def samples_html(samples: list[dict], sample_steps: int) -> str:
    """Return the best and worst completion of a few evenly spread steps."""
    by_step: dict[int, list[dict]] = {}
    for sample in samples:
        if "step" in sample:
            by_step.setdefault(int(sample["step"]), []).append(sample)
    parts = []
    for step in pick_steps(sorted(by_step), sample_steps):
        chosen = sorted(by_step[step], key=lambda sample: {"best": 0, "worst": 1}.get(sample.get("kind"), 2))[:2]
        parts.append(f'<h3>Step {step}</h3><div class="step">{"".join(sample_card(sample) for sample in chosen)}</div>')
    return "".join(parts)


def eval_samples_html(evals: list[tuple[int, dict]], per_eval: int = 3) -> str:
    """Return a table of the first few greedy held-out completions of the first and last evaluation."""
    chosen = evals if len(evals) <= 2 else [evals[0], evals[-1]]
    rows = []
    for step, result in chosen:
        for sample in (result.get("samples") or [])[:per_eval]:
            rows.append(
                f"<tr><td>{step}</td><td>{escape(sample.get('question', ''))}</td>"
                f"<td>{escape(sample.get('answer', ''))}</td>"
                f"<td><pre>{escape(sample.get('completion', ''))}</pre></td>"
                f"<td>{number(sample.get('score'), 0)}</td></tr>"
            )
    if not rows:
        return ""
    header = "<tr><th>step</th><th>question</th><th>reference</th><th>greedy completion</th><th>score</th></tr>"
    return f"<table>{header}{''.join(rows)}</table>"


def eval_table_html(evals: list[tuple[int, dict]]) -> str:
    rows = "".join(
        f"<tr><td>{step}</td><td>{number(result.get('accuracy'))}</td>"
        f"<td>{number(result.get('completion_length'), 1)}</td>"
        f"<td>{number(result.get('truncated'))}</td></tr>"
        for step, result in evals
    )
    header = "<tr><th>step</th><th>held-out greedy accuracy</th><th>mean length (tokens)</th><th>truncated</th></tr>"
    return f"<table>{header}{rows}</table>"


# ---------------------------------------------------------------- the page


def build_report(run_dir: str | Path, sample_steps: int = 4) -> str:
    """Return the report page of a run directory as one HTML string (figures embedded)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    config_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    if not config_path.exists() and not metrics_path.exists():
        raise FileNotFoundError(f"{run_dir} holds neither config.yaml nor metrics.jsonl: not a polo run directory")
    config_text = config_path.read_text() if config_path.exists() else None
    rows = read_metrics(metrics_path)
    train_rows = [row for row in rows if "reward/mean" in row]
    eval_rows = [row for row in rows if "eval/accuracy" in row]
    evals = read_eval_files(run_dir)
    samples = read_samples(run_dir)

    figures = [
        accuracy_figure(train_rows, eval_rows),
        length_figure(train_rows, eval_rows),
        reward_figure(train_rows),
        kl_figure(train_rows),
        single_series_figure(train_rows, {"entropy": "policy entropy"}, "Entropy", "nats per token"),
        single_series_figure(
            train_rows,
            {"clip_fraction/low": "low", "clip_fraction/high": "high"},
            "Clipped token fraction",
            "fraction of tokens",
        ),
        single_series_figure(train_rows, {"grad_norm": "before clipping"}, "Gradient norm", "L2 norm"),
        single_series_figure([*train_rows, *eval_rows], TOOL_SERIES, "Tool use (multi-turn episodes)", "per episode"),
    ]
    images = "".join(f'<img alt="training curve" src="data:image/png;base64,{png}">' for png in figures if png)
    body = [
        f"<h1>polo run report <small>{escape(run_dir.resolve().name)}</small></h1>",
        f'<div class="meta">{escape(run_dir.resolve())}</div>',
        facts_html(config_text, train_rows, evals),
        "<h2>Curves</h2>",
        f'<div class="figures">{images}</div>'
        if images
        else '<p class="note">metrics.jsonl holds no training rows yet.</p>',
    ]
    if evals:
        body += ["<h2>Held-out evaluations</h2>", eval_table_html(evals)]
    body.append("<h2>Sample completions</h2>")
    if samples:
        body += [
            '<p class="note">Best and worst completion (by total reward) of a few steps.</p>',
            samples_html(samples, sample_steps),
        ]
    else:
        body.append('<p class="note">No samples.jsonl in this run.</p>')
    held_out = eval_samples_html(evals)
    if held_out:
        body += ["<h3>Held-out greedy completions</h3>", held_out]
    body += [
        "<h2>Config</h2>",
        f"<pre>{escape(config_text)}</pre>" if config_text else '<p class="note">No config.yaml in this run.</p>',
    ]
    title = f"polo report: {run_dir.resolve().name}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
        f"<body>{''.join(body)}</body></html>\n"
    )


def write_report(run_dir: str | Path, output: str | Path | None = None, sample_steps: int = 4) -> Path:
    """Write the report of `run_dir` to `output` (default `<run_dir>/report.html`) and return its path."""
    path = Path(output) if output is not None else Path(run_dir) / "report.html"
    page = build_report(run_dir, sample_steps=sample_steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
