"""Every language-model preset on the demo's task with the same sampling budget and seed.

For each of grpo, dr_grpo, dapo, rloo, reinforce_pp, gspo and ppo this runs its recipe
(`recipes/<name>_arith.yaml`: SmolLM2-135M-Instruct, two-digit addition, 8 prompts x 8
completions, at most 32 new tokens, seed 0) for the same number of steps, each in its own
subprocess, and reports: held-out greedy accuracy before and after (200 problems), the training
reward over the last 5 steps, the median step time, and the peak RSS of the process (so PPO's
policy + critic + reference + two optimizers are measured against GRPO's policy + optimizer).
It writes `<out>/algorithms.md` (the table), `<out>/reward_curves.png` and `<out>/results.json`.

    .venv/bin/python benchmarks/algorithms_lm.py                 # all presets, 20 steps each
    .venv/bin/python benchmarks/algorithms_lm.py --only ppo grpo --steps 10

The last line is `algorithms_lm improved=<k>/<n> ppo_vs_grpo_peak_rss=<ratio> ppo_vs_grpo_step_time=<ratio>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "ppo"]

CHILD = """
import sys
import polo
recipe, out, steps, eval_before, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
polo.train(recipe, [f"train.steps={steps}", f"output.dir={out}", "output.save_every=0", "output.progress=false",
                    f"eval.before={eval_before}", "eval.after=true", "output.plots=true", *extra])
"""


def run_recipe(
    recipe: Path, run_dir: Path, log_path: Path, steps: int, eval_before: bool, overrides: list[str] = ()
) -> dict:
    """Return the figures of `recipe` (plus `overrides`) trained in a child process (peak RSS: the child's rusage)."""
    log = log_path.open("w")
    started = time.perf_counter()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            str(recipe),
            str(run_dir),
            str(steps),
            "true" if eval_before else "false",
            *overrides,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"{run_dir.name} failed (status {status}); see {log_path}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [row for row in rows if "reward/mean" in row]
    evals = {row["step"]: row["eval/accuracy"] for row in rows if "eval/accuracy" in row}
    return {
        "name": run_dir.name,
        "steps": [row["step"] for row in train_rows],
        "reward": [row["reward/mean"] for row in train_rows],
        "accuracy": [row["accuracy"] for row in train_rows],
        "completion_length": [row["completion_length/mean"] for row in train_rows],
        "eval_before": evals.get(0),
        "eval_after": evals.get(steps),
        "final_reward": statistics.mean(row["reward/mean"] for row in train_rows[-5:]),
        "median_step_s": statistics.median(row["time/step"] for row in train_rows),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "wall_s": wall,
    }


def run_preset(name: str, out_dir: Path, steps: int, eval_before: bool) -> dict:
    """Train one preset's recipe (`recipes/<name>_arith.yaml`) in a child process; return its figures."""
    return run_recipe(
        ROOT / "recipes" / f"{name}_arith.yaml", out_dir / name, out_dir / f"{name}.log", steps, eval_before
    )


def moving_average(values: list[float], window: int = 5) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(results: list[dict], path: Path) -> None:
    """Two panels: the total training reward (each preset's own, shaping included) and the training accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for result in results:
        axes[0].plot(result["steps"], moving_average(result["reward"]), label=result["name"], linewidth=2)
        axes[1].plot(result["steps"], moving_average(result["accuracy"]), label=result["name"], linewidth=2)
    axes[0].set(
        xlabel="step",
        ylabel="training reward (moving average of 5)",
        title="Reward (DAPO's includes its length penalty)",
    )
    axes[1].set(
        xlabel="step", ylabel="sampled accuracy (moving average of 5)", title="Training accuracy, same sampling budget"
    )
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[1].legend(ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(results: list[dict], before: float | None) -> str:
    lines = [
        "| preset | held-out accuracy (greedy, 200) | training reward, last 5 steps | median step | peak RSS |",
        "| --- | --- | --- | --- | --- |",
    ]
    for result in results:
        after = result["eval_after"]
        lines.append(
            f"| {result['name']} | {before:.3f} → {after:.3f} | {result['final_reward']:.3f} | "
            f"{result['median_step_s']:.1f} s | {result['peak_rss_bytes'] / 2**30:.1f} GiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=PRESETS, choices=PRESETS)
    parser.add_argument("--out", default=str(ROOT / "runs" / "algorithms_lm"))
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from <out>/results.json without training")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.replot:
        plot(json.loads((out_dir / "results.json").read_text()), out_dir / "reward_curves.png")
        return

    results = []
    for index, name in enumerate(args.only):
        # Every preset starts from the same model on the same held-out set: evaluate it once.
        result = run_preset(name, out_dir, args.steps, eval_before=index == 0)
        results.append(result)
        print(
            f"{name:>13}: held-out {results[0]['eval_before']:.3f} -> {result['eval_after']:.3f}  "
            f"reward(last 5) {result['final_reward']:.3f}  step {result['median_step_s']:.1f} s  "
            f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB  wall {result['wall_s']:.0f} s",
            flush=True,
        )
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    before = results[0]["eval_before"]
    markdown = table(results, before)
    (out_dir / "algorithms.md").write_text(markdown + "\n")
    plot(results, out_dir / "reward_curves.png")
    print(markdown)
    improved = sum(result["eval_after"] > before for result in results)
    by_name = {result["name"]: result for result in results}
    ratios = ""
    if "ppo" in by_name and "grpo" in by_name:
        ppo, grpo = by_name["ppo"], by_name["grpo"]
        ratios = (
            f" ppo_vs_grpo_peak_rss={ppo['peak_rss_bytes'] / grpo['peak_rss_bytes']:.2f}"
            f" ppo_vs_grpo_step_time={ppo['median_step_s'] / grpo['median_step_s']:.2f}"
        )
    print(f"algorithms_lm improved={improved}/{len(results)}{ratios}")


if __name__ == "__main__":
    main()
