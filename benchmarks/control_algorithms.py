"""Steps to solve CartPole-v1 for every polo.control algorithm, over several seeds, plus one PNG.

    python benchmarks/control_algorithms.py                       # the five CartPole recipes, 5 seeds
    python benchmarks/control_algorithms.py --recipes recipes/ppo_acrobot.yaml recipes/ppo_pendulum.yaml \
        --max-steps 500000 --png docs/images/control_ppo_acrobot_pendulum.png

A run is "solved" the first time the mean return of its last 20 training episodes reaches the
recipe's `train.target_return` (475 for CartPole); it stops there. Each recipe's own step
budget applies, capped at --max-steps. Prints one table row per recipe and seed, then a
summary line per recipe; the curves (mean of the last 20 episodes against environment
steps, one line per seed) go to --png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPES = [f"recipes/{name}_cartpole.yaml" for name in ("reinforce", "a2c", "trpo", "ppo", "grpo")]


def rolling_curve(end_steps: list[int], returns: list[float], window: int = 20) -> tuple[list[int], list[float]]:
    """Return (steps, mean of the last `window` returns) at every episode end."""
    means, total = [], 0.0
    for index, value in enumerate(returns):
        total += value
        if index >= window:
            total -= returns[index - window]
        means.append(total / min(index + 1, window))
    return end_steps, means


def run_one(recipe: str, seed: int, max_steps: int) -> dict:
    """Train one recipe with one seed until solved or out of budget; return its figures and curve."""
    from polo.control import load_control_config, train

    config = load_control_config(ROOT / recipe if not Path(recipe).is_absolute() else recipe)
    config.train.seed = seed
    config.train.stop_at_target = True
    config.train.total_steps = min(config.train.total_steps, max_steps)
    result = train(config, write_files=False)
    steps, curve = rolling_curve(result.episode_end_steps, result.episode_returns, config.train.solve_window)
    return {
        "recipe": recipe,
        "algorithm": config.algorithm.name,
        "env": config.env.id,
        "seed": seed,
        "target": config.train.target_return,
        "budget": config.train.total_steps,
        "solved_at_step": result.solved_at_step,
        "solved_at_seconds": result.solved_at_seconds,
        "env_steps": result.env_steps,
        "seconds": result.seconds,
        "last20": result.last_mean(config.train.solve_window),
        "curve_steps": steps,
        "curve": curve,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = list(dict.fromkeys(r["recipe"] for r in results))
    envs = list(dict.fromkeys(r["env"] for r in results))
    figure, axes = plt.subplots(1, len(envs), figsize=(7 * len(envs), 4.5), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for env_index, env in enumerate(envs):
        axis = axes[0, env_index]
        for recipe_index, recipe in enumerate(
            r for r in recipes if any(x["recipe"] == r and x["env"] == env for x in results)
        ):
            runs = [r for r in results if r["recipe"] == recipe]
            solved = sum(r["solved_at_step"] is not None for r in runs)
            for run_index, run in enumerate(runs):
                axis.plot(
                    run["curve_steps"],
                    run["curve"],
                    color=colours[recipe_index % len(colours)],
                    alpha=0.7,
                    linewidth=1.2,
                    label=f"{run['algorithm']} ({solved}/{len(runs)} solved)" if run_index == 0 else None,
                )
        target = runs[0]["target"]
        if target is not None:
            axis.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
        axis.set(
            xlabel="environment steps",
            ylabel="mean return of the last 20 episodes",
            title=f"{env} (one line per seed; runs stop when solved)",
        )
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=300_000)
    parser.add_argument("--png", default="docs/images/control_cartpole.png")
    parser.add_argument("--json", default="runs/control_algorithms.json", help="raw results (curves included)")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    results = []
    print(f"{'recipe':<32} {'seed':>4} {'solved at':>10} {'seconds':>8} {'last-20 at stop':>15}", flush=True)
    for recipe in args.recipes:
        for seed in range(args.seeds):
            result = run_one(recipe, seed, args.max_steps)
            results.append(result)
            solved = "-" if result["solved_at_step"] is None else f"{result['solved_at_step']:,}"
            seconds = result["solved_at_seconds"] if result["solved_at_seconds"] is not None else result["seconds"]
            print(f"{recipe:<32} {seed:>4} {solved:>10} {seconds:>8.1f} {result['last20']:>15.1f}", flush=True)
    json_path = ROOT / args.json
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results))
    plot(results, ROOT / args.png)
    print(f"curves: {args.png}; raw results: {args.json}")
    print()
    print(
        "| algorithm | env | target | budget | "
        + " | ".join(f"seed {s}" for s in range(args.seeds))
        + " | solved | median steps |"
    )
    print("|---|---|---|---|" + "---|" * args.seeds + "---|---|")
    all_ok = True
    for recipe in args.recipes:
        runs = [r for r in results if r["recipe"] == recipe]
        steps = [r["solved_at_step"] for r in runs if r["solved_at_step"] is not None]
        cells = [f"{r['solved_at_step']:,}" if r["solved_at_step"] is not None else "not solved" for r in runs]
        median = f"{statistics.median(steps):,.0f}" if steps else "-"
        print(
            f"| {runs[0]['algorithm']} | {runs[0]['env']} | {runs[0]['target']:g} | {runs[0]['budget']:,} | "
            + " | ".join(cells)
            + f" | {len(steps)}/{len(runs)} | {median} |"
        )
        all_ok &= len(steps) >= len(runs) - 1
    for recipe in args.recipes:
        runs = [r for r in results if r["recipe"] == recipe]
        solved = sum(r["solved_at_step"] is not None for r in runs)
        print(f"control_algorithms recipe={recipe} solved={solved}/{len(runs)}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
