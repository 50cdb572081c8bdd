"""Does the fast path learn like the plain one? GRPO reward curves with polo's bf16 default and in fp32.

Runs `recipes/grpo_arith.yaml` (the demo's task and model) for the same number of steps, each in
its own subprocess:

  fp32       train.precision=fp32, seed 0: the plain path
  fast       train.precision=auto, seed 0: where the CPU has native bf16, bf16 weights for every
             forward and backward with fp32 master weights and AdamW state (bf16_master)
  fp32_seed1 train.precision=fp32, seed 1: how far two fp32 runs drift apart by chance
  lora       (with --lora) the fast path training LoRA adapters (model.lora.r=16, alpha 32, every
             linear layer) at 15x the learning rate: Schulman et al., "LoRA Without Regret" (Thinking
             Machines, 2025) found LoRA's best rate about 10x full fine-tuning's, about 15x for runs
             of under 100 steps; shown beside, not part of the noise verdict

The two seed-0 runs see the same prompts in the same order; their sampled completions part ways at
the first token drawn from slightly different probabilities, so the curves are compared as curves,
not step by step. The gap between two curves is the mean absolute difference of their 5-step
moving averages of the training reward; the fast path is "within run-to-run noise" when its gap
to fp32 is no larger than the gap between the two fp32 seeds.

    .venv/bin/python benchmarks/precision_curves.py             # 30 steps each (about 30 minutes on 2 cores)
    .venv/bin/python benchmarks/precision_curves.py --steps 10

Writes `<out>/precision_curves.png` and `<out>/results.json`; the last line is
`precision_curves fast_vs_fp32_gap=<g> fp32_seed_gap=<g> within_noise=<true|false> fast_vs_fp32_step_time=<ratio>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms_lm import ROOT, moving_average, run_recipe

RECIPE = ROOT / "recipes" / "grpo_arith.yaml"
RUNS = {  # name -> overrides
    "fp32": ["train.precision=fp32", "train.seed=0"],
    "fast": ["train.precision=auto", "train.seed=0"],
    "fp32_seed1": ["train.precision=fp32", "train.seed=1"],
}
LORA_RUN = [
    "train.precision=auto",
    "train.seed=0",
    "model.lora.r=16",
    "model.lora.alpha=32",
    "train.learning_rate=7.5e-5",
]


def curve_gap(a: list[float], b: list[float], window: int = 5) -> float:
    """Mean |difference| of the two curves' moving averages over their common steps."""
    n = min(len(a), len(b))
    return statistics.mean(abs(x - y) for x, y in zip(moving_average(a[:n], window), moving_average(b[:n], window)))


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "fp32": ("tab:blue", "-"),
        "fast": ("tab:orange", "-"),
        "fp32_seed1": ("tab:blue", ":"),
        "lora": ("tab:green", "--"),
    }
    labels = {
        "fp32": "fp32, seed 0",
        "fast": "bf16 weights + fp32 masters (polo's default), seed 0",
        "fp32_seed1": "fp32, seed 1 (noise)",
        "lora": "LoRA r=16 on the default path, lr x15, seed 0",
    }
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, result in results.items():
        color, style = styles[name]
        axes[0].plot(result["steps"], result["reward"], color=color, linestyle=style, alpha=0.25, linewidth=1)
        axes[0].plot(
            result["steps"],
            moving_average(result["reward"]),
            color=color,
            linestyle=style,
            linewidth=2,
            label=labels[name],
        )
        axes[1].plot(
            result["steps"],
            moving_average(result["completion_length"]),
            color=color,
            linestyle=style,
            linewidth=2,
            label=labels[name],
        )
    axes[0].set(
        xlabel="step",
        ylabel="training reward (thin: per step; thick: moving average of 5)",
        title="Reward: polo's bf16 default vs fp32",
    )
    axes[1].set(xlabel="step", ylabel="mean completion length (tokens, moving average of 5)", title="Response length")
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / "runs" / "precision_curves"))
    parser.add_argument("--replot", action="store_true", help="redraw the PNG and the summary from <out>/results.json")
    parser.add_argument("--lora", action="store_true", help="also train LoRA adapters on the fast path (shown beside)")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.replot:
        results = json.loads((out_dir / "results.json").read_text())
    else:
        results = {}
        for name, overrides in {**RUNS, **({"lora": LORA_RUN} if args.lora else {})}.items():
            result = run_recipe(
                RECIPE,
                out_dir / name,
                out_dir / f"{name}.log",
                args.steps,
                eval_before=name == "fp32",
                overrides=overrides,
            )
            results[name] = result
            print(
                f"{name:>10}: held-out after {result['eval_after']:.3f}  reward(last 5) {result['final_reward']:.3f}  "
                f"median step {result['median_step_s']:.1f} s  peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB",
                flush=True,
            )
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out_dir / "precision_curves.png")
    fast_gap = curve_gap(results["fast"]["reward"], results["fp32"]["reward"])
    seed_gap = curve_gap(results["fp32_seed1"]["reward"], results["fp32"]["reward"])
    speed = results["fp32"]["median_step_s"] / results["fast"]["median_step_s"]
    print(
        f"held-out greedy accuracy before {results['fp32']['eval_before']:.3f}; after: "
        + ", ".join(f"{name} {result['eval_after']:.3f}" for name, result in results.items())
    )
    print(
        "mean training reward over all steps: "
        + ", ".join(f"{name} {statistics.mean(r['reward']):.3f}" for name, r in results.items())
    )
    print(
        f"precision_curves fast_vs_fp32_gap={fast_gap:.3f} fp32_seed_gap={seed_gap:.3f} "
        f"within_noise={'true' if fast_gap <= seed_gap else 'false'} fast_vs_fp32_step_time={speed:.2f}"
    )


if __name__ == "__main__":
    main()
