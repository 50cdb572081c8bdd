"""RL against a learned reward model vs RL against the rule-based checker, from their metrics.

Reads finished `polo train` run directories (no training here) and draws three panels: the
accuracy of each run's training samples under the rule-based checker (the truth, which the
reward-model runs never optimise), held-out greedy accuracy at each evaluation, and the reward
model's own mean score on the training samples of the runs that optimise it.

    .venv/bin/python benchmarks/rlhf_curves.py \
        "checker (control)=runs/grpo_arith" "reward model=runs/rlhf_rl_samples" \
        "reward model, KL 0.04=/tmp/rl_kl" -o docs/images/rlhf_samples.png

The last line is `rlhf_curves <label>: final_greedy=<acc> ...` for each run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms_lm import moving_average


def read_run(directory: Path) -> dict:
    """Return the per-step training columns and the held-out evaluations of one run directory."""
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [row for row in rows if "loss" in row]
    greedy = sorted({int(row["step"]): row["eval/accuracy"] for row in rows if "eval/accuracy" in row}.items())
    return {
        "steps": [row["step"] for row in train],
        "correct": [row.get("reward/correct/mean", row.get("accuracy", 0.0)) for row in train],
        "rm": [row["reward/rm/mean"] for row in train] if train and "reward/rm/mean" in train[0] else None,
        "greedy": greedy,
    }


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for (label, run), color in zip(runs.items(), ["tab:gray", "tab:blue", "tab:green", "tab:orange", "tab:red"]):
        axes[0].plot(run["steps"], run["correct"], color=color, alpha=0.2, linewidth=1)
        axes[0].plot(run["steps"], moving_average(run["correct"]), color=color, linewidth=2, label=label)
        steps, accuracy = zip(*run["greedy"]) if run["greedy"] else ((), ())
        axes[1].plot(steps, accuracy, color=color, marker="o", linewidth=2, label=label)
        if run["rm"] is not None:
            axes[2].plot(run["steps"], moving_average(run["rm"]), color=color, linewidth=2, label=label)
    axes[0].set(
        xlabel="step",
        ylabel="training samples correct (checker; thick: moving average of 5)",
        title="True correctness while training",
    )
    axes[1].set(xlabel="step", ylabel="held-out greedy accuracy (200 problems)", title="Held-out accuracy")
    axes[2].set(
        xlabel="step",
        ylabel="reward-model score, normalised (moving average of 5)",
        title="What the reward-model runs optimise",
    )
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR, a finished polo train run directory each")
    parser.add_argument("-o", "--output", default="docs/images/rlhf_samples.png")
    args = parser.parse_args()
    runs = {}
    for item in args.runs:
        label, _, directory = item.rpartition("=")
        if not label or not (Path(directory) / "metrics.jsonl").exists():
            parser.error(f"{item!r}: expected LABEL=RUN_DIR with a metrics.jsonl in RUN_DIR")
        runs[label] = read_run(Path(directory))
    plot(runs, Path(args.output))
    print(f"wrote {args.output}")
    print(
        "rlhf_curves "
        + " ".join(
            f"{label.replace(' ', '_')}:final_greedy={run['greedy'][-1][1]:.3f}"
            for label, run in runs.items()
            if run["greedy"]
        )
    )


if __name__ == "__main__":
    main()
