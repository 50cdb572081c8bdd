"""polo's PPO against Stable-Baselines3's PPO on CartPole-v1: steps and seconds until solved.

    pip install -e .[bench]        # stable-baselines3==2.9.2
    python benchmarks/cartpole_vs_sb3.py [--seeds 5] [--budget 100000]

Both run the rl-zoo tuned CartPole hyperparameters: 8 envs, n_steps 32, batch 256 (one
minibatch per epoch), 20 epochs, γ 0.98, λ 0.8, learning rate linear from 1e-3 and clip range
linear from 0.2 over a 100k-step schedule, no entropy bonus, gradient norm clipped at 0.5,
64-64 tanh networks for actor and critic (polo: recipes/ppo_cartpole.yaml). Each seed is one
run of each library, interleaved polo/SB3 so both see the same machine load, in this one
process, with torch on one thread for both.

A run is solved the first time the mean return of its last 20 training episodes reaches 475;
it stops there. Reported per run: environment steps and wall seconds to that point (wall
time from building the environments and networks, imports excluded), and CPU seconds as a
load-robust cross-check. The last line is (on one line)

    polo_vs_sb3 steps_ratio=<polo median / sb3 median> time_ratio=<polo median / sb3 median>
        polo_solved=<k>/5 sb3_solved=<k>/5

with medians over the solved runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import ForeignLoad  # noqa: E402

TARGET = 475.0
WINDOW = 20


def run_polo(seed: int, budget: int) -> dict:
    """Return steps / wall / CPU seconds to solve (None when unsolved) for polo's PPO."""
    from polo.control import load_control_config, train

    config = load_control_config(ROOT / "recipes" / "ppo_cartpole.yaml")
    config.train.seed = seed
    config.train.total_steps = budget
    config.train.target_return = TARGET
    config.train.solve_window = WINDOW
    config.train.stop_at_target = True
    cpu_start = time.process_time()
    result = train(config, write_files=False)
    cpu = time.process_time() - cpu_start
    solved = result.solved_at_step is not None
    return {
        "steps": result.solved_at_step,
        "seconds": result.solved_at_seconds,
        "cpu": cpu if solved else None,
        "total_steps": result.env_steps,
    }


def run_sb3(seed: int, budget: int) -> dict:
    """Return steps / wall / CPU seconds to solve (None when unsolved) for SB3's PPO."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    started, cpu_start = time.perf_counter(), time.process_time()

    class StopWhenSolved(BaseCallback):
        """Tracks the last 20 finished episodes (from SB3's Monitor) after every vector step."""

        def __init__(self):
            super().__init__()
            self.recent: deque[float] = deque(maxlen=WINDOW)
            self.solved: tuple[int, float, float] | None = None

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                episode = info.get("episode")
                if episode is None:
                    continue
                self.recent.append(float(episode["r"]))
                if len(self.recent) == WINDOW and sum(self.recent) / WINDOW >= TARGET:
                    self.solved = (self.num_timesteps, time.perf_counter() - started, time.process_time() - cpu_start)
                    return False
            return True

    def linear(start: float):
        return lambda progress_remaining: progress_remaining * start

    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=256,
        n_epochs=20,
        gamma=0.98,
        gae_lambda=0.8,
        learning_rate=linear(1e-3),
        clip_range=linear(0.2),
        ent_coef=0.0,
        seed=seed,
        device="cpu",
        verbose=0,
    )
    callback = StopWhenSolved()
    model.learn(total_timesteps=budget, callback=callback)
    env.close()
    steps, seconds, cpu = callback.solved if callback.solved else (None, None, None)
    return {"steps": steps, "seconds": seconds, "cpu": cpu, "total_steps": model.num_timesteps}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> str:
    return "nan" if numerator is None or not denominator else f"{numerator / denominator:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--budget", type=int, default=100_000, help="environment steps per run (also the schedules' horizon)"
    )
    args = parser.parse_args(argv)

    import stable_baselines3
    import torch

    import polo.control

    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, stable-baselines3 {stable_baselines3.__version__}; torch threads 1; "
        f"target: mean of the last {WINDOW} episodes >= {TARGET:g}; budget {args.budget:,} steps",
        flush=True,
    )
    runners = {"polo": run_polo, "sb3": run_sb3}
    results: dict[str, list[dict]] = {name: [] for name in runners}
    # One throwaway short run each, so one-off lazy initialisation is not billed to seed 0.
    for runner in runners.values():
        runner(100, 512)
    print(f"{'library':<6} {'seed':>4} {'steps':>8} {'wall s':>7} {'cpu s':>6} {'other procs (cores)':>20}", flush=True)
    for seed in range(args.seeds):
        for name, runner in runners.items():
            load = ForeignLoad()
            result = runner(seed, args.budget)
            result["foreign_cores"] = load.cores()
            results[name].append(result)
            print(
                f"{name:<6} {seed:>4} {fmt(result['steps'], ',d'):>8} {fmt(result['seconds'], '.2f'):>7} "
                f"{fmt(result['cpu'], '.2f'):>6} {result['foreign_cores']:>20.2f}",
                flush=True,
            )
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "steps": median([r["steps"] for r in runs]),
            "seconds": median([r["seconds"] for r in runs]),
            "cpu": median([r["cpu"] for r in runs]),
            "solved": sum(r["steps"] is not None for r in runs),
        }
        s = summary[name]
        print(
            f"{name}: solved {s['solved']}/{len(runs)}; median {fmt(s['steps'], ',.0f')} steps, "
            f"{fmt(s['seconds'], '.2f')} s wall, {fmt(s['cpu'], '.2f')} s CPU"
        )
    polo, sb3 = summary["polo"], summary["sb3"]
    print(
        f"cpu_time_ratio={ratio(polo['cpu'], sb3['cpu'])} (polo median CPU seconds / SB3's; insensitive to other load)"
    )
    print(
        f"polo_vs_sb3 steps_ratio={ratio(polo['steps'], sb3['steps'])} "
        f"time_ratio={ratio(polo['seconds'], sb3['seconds'])} "
        f"polo_solved={polo['solved']}/{args.seeds} sb3_solved={sb3['solved']}/{args.seeds}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
