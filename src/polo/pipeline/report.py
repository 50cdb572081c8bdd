"""The pipeline's report: one HTML page with each stage's contribution and the curves of all stages joined.

Reads only what the stages wrote (`stage_done.json`, `stage_eval.json`, `metrics.jsonl`,
`rejection_summary.json`, `rejection.jsonl`, `demos.jsonl`) and `<dir>/base/stage_eval.json`, so
it can be drawn again at any time from the directories alone.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

from polo.evaluation.plots import R1_FORMAT_KEY, R1_PANELS
from polo.evaluation.report import STYLE, escape, figure_png
from polo.pipeline.stage_eval import EVAL_FILE, headline, read_json
from polo.runtime.metrics import read_metrics

SFT_KINDS = ("sft", "reject_sft")
TABLE_COLUMNS = (
    ("greedy_accuracy", "greedy accuracy (tagged)"),
    ("greedy_format", "greedy r1_format"),
    ("format", "r1_format rate (samples)"),
    ("pass@1", "pass@1 over K"),
    ("cons@k", "cons@K"),
    ("length", "mean length (tokens)"),
)


def stage_entries(pipeline_dir: Path, labels: list[str]) -> list[dict]:
    """Return, per finished stage in order, its marker plus its metrics rows (stages not finished are left out)."""
    entries = []
    for label in labels:
        stage_dir = pipeline_dir / label
        done = read_json(stage_dir / "stage_done.json")
        if done is None:
            continue
        done["dir"] = stage_dir
        done["rows"] = read_metrics(stage_dir / "metrics.jsonl") if (stage_dir / "metrics.jsonl").exists() else []
        entries.append(done)
    return entries


def stage_length(entry: dict) -> int:
    """Return how many x-axis steps a stage takes: its RL steps, or its SFT optimizer steps (at least 1)."""
    details = entry.get("details") or {}
    steps = details.get("steps") or (details.get("sft") or {}).get("steps") or 0
    logged = [row["step"] for row in entry["rows"] if isinstance(row.get("step"), (int, float))]
    return max(int(steps), int(max(logged, default=0)), 1)


def fmt(value: object, digits: int = 3) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else escape(value)


def table_html(base: dict | None, entries: list[dict]) -> str:
    """Return the stage table: the starting model, then each stage's numbers, change in pass@1 and time."""
    header = "<tr><th>after</th><th>kind</th>" + "".join(f"<th>{escape(label)}</th>" for _, label in TABLE_COLUMNS)
    header += "<th>Δ pass@1</th><th>stage time</th><th>eval time</th><th>notes</th></tr>"
    rows, previous = [], headline(base)["pass@1"] if base else float("nan")
    lines = [("start (no training)", "", base, None, "")] if base else []
    lines += [
        (entry["label"], entry["kind"], entry.get("evaluation"), entry.get("seconds"), stage_notes(entry))
        for entry in entries
    ]
    for label, kind, evaluation, seconds, notes in lines:
        numbers = headline(evaluation)
        change = numbers["pass@1"] - previous
        previous = numbers["pass@1"] if not math.isnan(numbers["pass@1"]) else previous
        eval_seconds = (evaluation or {}).get("seconds")
        cells = (
            "".join(f"<td>{fmt(numbers[key])}</td>" for key, _ in TABLE_COLUMNS[:-1])
            + f"<td>{fmt(numbers['length'], 1)}</td>"
        )
        rows.append(
            f"<tr><td>{escape(label)}</td><td>{escape(kind)}</td>{cells}"
            f"<td>{'' if seconds is None else fmt(change)}</td>"
            f"<td>{'' if seconds is None else f'{seconds / 60:.1f} min'}</td>"
            f"<td>{'' if eval_seconds is None else f'{eval_seconds / 60:.1f} min'}</td><td>{escape(notes)}</td></tr>"
        )
    return f"<table>{header}{''.join(rows)}</table>"


def total_time(base: dict | None, entries: list[dict]) -> str:
    """Return the pipeline's wall time as stages plus evaluations (as recorded when each ran)."""
    stages = sum(entry.get("seconds") or 0.0 for entry in entries)
    evaluations = sum(
        (evaluation or {}).get("seconds") or 0.0
        for evaluation in [base] + [entry.get("evaluation") for entry in entries]
    )
    return (
        f"Total: {(stages + evaluations) / 60:.1f} min ({stages / 60:.1f} min of stages, "
        f"{evaluations / 60:.1f} min of evaluations)."
    )


def stage_notes(entry: dict) -> str:
    """Return a short line about what a stage did (its steps, demonstrations, rejection counts)."""
    details = entry.get("details") or {}
    rejection = details.get("rejection")
    if rejection:
        text = (
            f"kept {rejection['kept']} of {rejection['sampled']} samples from {rejection['prompts']} prompts "
            f"(acceptance {rejection['acceptance_rate']:.3f}, at most {rejection['max_per_prompt']} per prompt)"
        )
        return text + ("" if details.get("sft") else "; too few kept, no SFT")
    parts = []
    if details.get("demonstrations"):
        parts.append(f"{details['demonstrations']} demonstrations")
    if details.get("steps"):
        parts.append(f"{details['steps']} {'RL' if entry['kind'] == 'grpo' else 'SFT'} steps")
    return ", ".join(parts)


def joined_figure(base: dict | None, entries: list[dict]) -> str | None:
    """Return the R1 panels of every stage on one x-axis (stage boundaries marked, stage-end evaluations as points)."""
    if not entries:
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 9))
    axes = figure.subplots(3, 1, sharex=True)
    offset, labelled = 0, False
    draw_evaluation_points(axes, 0, base)
    for entry in entries:
        length = stage_length(entry)
        if entry["kind"] in SFT_KINDS:
            for axis in axes:
                axis.axvspan(offset, offset + length, color="#cccccc", alpha=0.35, linewidth=0)
        else:
            draw_rl_curves(axes, entry["rows"], offset, labelled=not labelled)
            labelled = True
        offset += length
        for axis in axes:
            axis.axvline(offset, color="#555555", linestyle="--", linewidth=0.8)
        axes[0].text(
            offset - length / 2,
            0.97,
            entry["label"],
            ha="center",
            va="top",
            fontsize=8,
            transform=axes[0].get_xaxis_transform(),
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
        draw_evaluation_points(axes, offset, entry.get("evaluation"))
    for axis, (title, ylabel) in zip(axes, R1_PANELS):
        axis.set_ylabel(ylabel)
        axis.set_title(title, fontsize=10, loc="left")
        axis.grid(alpha=0.3)
    axes[0].set_ylim(-0.02, 1.12)  # room for the stage names
    axes[1].set_ylim(-0.02, 1.02)
    axes[-1].set_xlabel("step, stage after stage (SFT stages shaded: optimizer steps; RL stages: RL steps)")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(
            dict(zip(labels, handles)).values(), dict(zip(labels, handles)).keys(), fontsize=8, loc="lower right"
        )
    return figure_png(figure)


def draw_rl_curves(axes, rows: list[dict], offset: int, labelled: bool) -> None:
    """Draw one RL stage's held-out accuracy, r1_format rate and mean length, shifted right by `offset` (legend
    labels when `labelled`)."""

    def series(key: str, train: bool) -> tuple[list[float], list[float]]:
        points = [
            (offset + row["step"], row[key])
            for row in rows
            if isinstance(row.get(key), (int, float)) and ("reward/mean" in row) == train
        ]
        return [x for x, _ in points], [y for _, y in points]

    label = (lambda text: text) if labelled else (lambda text: None)
    marker = "o" if len(series("accuracy", True)[0]) < 3 else None  # a one-step stage is a point, not an invisible line
    axes[0].plot(
        *series("eval/accuracy", False),
        "o-",
        color="#dd8452",
        linewidth=2,
        markersize=3,
        label=label("held-out greedy (during RL)"),
    )
    axes[0].plot(
        *series("accuracy", True), color="#4c72b0", alpha=0.5, marker=marker, label=label("train accuracy (sampled)")
    )
    axes[1].plot(
        *series(R1_FORMAT_KEY, True),
        color="#55a868",
        linewidth=1.5,
        marker=marker,
        label=label("r1_format reward (sampled)"),
    )
    axes[2].plot(
        *series("completion_length/mean", True),
        color="#8172b3",
        linewidth=1.5,
        marker=marker,
        label=label("mean length (sampled)"),
    )


def draw_evaluation_points(axes, x: float, evaluation: dict | None) -> None:
    """Mark a stage-end evaluation: greedy accuracy and pass@1 on the first panel, format and length below."""
    if not evaluation:
        return
    numbers = headline(evaluation)
    axes[0].plot(
        [x], [numbers["greedy_accuracy"]], "s", color="#c44e52", markersize=7, label="stage-end greedy accuracy"
    )
    axes[0].plot(
        [x],
        [numbers["pass@1"]],
        "D",
        color="#937860",
        markersize=6,
        label=f"stage-end pass@1 over {numbers['samples']}",
    )
    axes[1].plot([x], [numbers["format"]], "D", color="#937860", markersize=6)
    axes[2].plot([x], [numbers["length"]], "D", color="#937860", markersize=6)


def examples_html(entries: list[dict], per_stage: int = 2) -> str:
    """Return a few of the SFT stages' training examples (cold-start demonstrations, kept rejection samples)."""
    parts = []
    for entry in entries:
        for name in ("demos.jsonl", "rejection.jsonl"):
            path = entry["dir"] / name
            if not path.exists():
                continue
            rows = [json.loads(line) for line in path.read_text().splitlines()[:per_stage] if line.strip()]
            cards = "".join(f"<pre>{escape(row.get('response', ''))}</pre>" for row in rows)
            parts.append(f"<h3>{escape(entry['label'])}: {escape(name)}</h3>{cards or '<p class=note>empty</p>'}")
    return "".join(parts)


def build_pipeline_report(pipeline_dir: str | Path, labels: list[str], figure_path: Path | None = None) -> str:
    """Return the pipeline's report page as one HTML string (figures embedded); also write the joined curves to
    `figure_path`."""
    pipeline_dir = Path(pipeline_dir)
    base = read_json(pipeline_dir / "base" / EVAL_FILE)
    entries = stage_entries(pipeline_dir, labels)
    for entry in entries:
        evaluation = read_json(entry["dir"] / EVAL_FILE)
        if evaluation is not None:
            entry["evaluation"] = evaluation
    settings = (base or (entries[0].get("evaluation") if entries else None) or {}).get("settings", {})
    figure = joined_figure(base, entries)
    if figure and figure_path is not None:
        figure_path.write_bytes(base64.b64decode(figure))
    body = [
        f"<h1>polo pipeline report <small>{escape(pipeline_dir.resolve().name)}</small></h1>",
        f'<div class="meta">{escape(pipeline_dir.resolve())}</div>',
        "<h2>What each stage added</h2>",
        f'<p class="note">Held-out evaluation after each stage on {escape(settings.get("num_problems", "?"))} '
        f"problems of {escape(settings.get('task', '?'))}: greedy decoding, then "
        f"{escape(settings.get('samples', 'K'))} samples per problem "
        f"at T={escape(settings.get('temperature', '?'))}, top-p {escape(settings.get('top_p', '?'))} "
        f"(max {escape(settings.get('max_new_tokens', '?'))} new tokens). Stage time excludes the evaluation.</p>",
        table_html(base, entries),
        f'<p class="note">{total_time(base, entries)}</p>',
        "<h2>Curves, all stages joined</h2>",
        f'<div class="figures"><img alt="pipeline curves" src="data:image/png;base64,{figure}"></div>'
        if figure
        else '<p class="note">No stage has finished yet.</p>',
    ]
    examples = examples_html(entries)
    if examples:
        body += ["<h2>Training examples of the SFT stages</h2>", examples]
    pipeline_yaml = pipeline_dir / "pipeline.yaml"
    if pipeline_yaml.exists():
        body += ["<h2>Pipeline recipe</h2>", f"<pre>{escape(pipeline_yaml.read_text())}</pre>"]
    title = f"polo pipeline: {pipeline_dir.resolve().name}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
        f"<body>{''.join(body)}</body></html>\n"
    )


def write_pipeline_report(pipeline_dir: str | Path, labels: list[str]) -> Path:
    """Return the path of `<pipeline_dir>/report.html`, written for the stages `labels` (and the joined curves alone
    as `curves.png`)."""
    path = Path(pipeline_dir) / "report.html"
    path.write_text(build_pipeline_report(pipeline_dir, labels, Path(pipeline_dir) / "curves.png"), encoding="utf-8")
    return path
