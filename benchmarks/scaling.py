"""Data-parallel scaling: GRPO samples per second with 1 and with 2 processes (1 thread each).

Runs the main job's recipe (GRPO, SmolLM2-135M-Instruct, 8 prompts x 8 completions per step)
under `torchrun --nproc_per_node N` for a few steps and measures the wall time between
consecutive step rows of metrics.jsonl (so model loading, the first step's warm-up and the
final checkpoint are left out). Both runs do the same work per step: N processes each sample
8/N prompts. The last line is the 2-process / 1-process throughput ratio (2.0 would be perfect).

    .venv/bin/python benchmarks/scaling.py [--steps 5] [--processes 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import TIMED_RUN_OVERRIDES

ROOT = Path(__file__).resolve().parent.parent


def run(processes: int, steps: int, output_dir: Path, recipe: str, extra: list[str], threads: int = 1) -> dict:
    """Return throughput figures from the metrics of `steps` steps trained with `processes` ranks of `threads`
    threads."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "polo",
        "train",
        recipe,
        f"train.steps={steps}",
        f"train.threads={threads}",
        *TIMED_RUN_OVERRIDES,
        f"output.dir={output_dir}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]
    stamps = [row["timestamp"] for row in rows]
    step_seconds = (stamps[-1] - stamps[0]) / (len(stamps) - 1)  # steps 2..K: warm-up excluded
    completions = rows[-1]["completion_length/mean"]  # for the reader: similar lengths mean similar work
    config = yaml.safe_load((output_dir / "config.yaml").read_text())
    samples = config["train"]["prompts_per_step"] * config["algorithm"]["group_size"]
    update = sum(row["time/update"] for row in rows[1:]) / (len(rows) - 1)
    generation = sum(row["time/generation"] for row in rows[1:]) / (len(rows) - 1)
    return {
        "processes": processes,
        "threads": threads,
        "step_seconds": step_seconds,
        "samples_per_second": samples / step_seconds,
        "generation_seconds": generation,
        "update_seconds": update,
        "mean_completion_tokens": completions,
        "total_wall_seconds": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--recipe", default="recipes/grpo_arith.yaml")
    parser.add_argument(
        "--threads-baseline",
        type=int,
        default=2,
        help="also time 1 process with this many threads (the way one machine is used without torchrun); 0 skips it",
    )
    parser.add_argument("overrides", nargs="*", help="extra dotted.key=value overrides for both runs")
    args = parser.parse_args()
    results = []
    runs = [(processes, 1) for processes in args.processes]
    if args.threads_baseline:
        runs.append((1, args.threads_baseline))
    with tempfile.TemporaryDirectory(prefix="polo-scaling-") as scratch:
        for processes, threads in runs:
            result = run(
                processes, args.steps, Path(scratch) / f"n{processes}t{threads}", args.recipe, args.overrides, threads
            )
            results.append(result)
            print(
                f"{processes} process(es) x {threads} thread(s): {result['step_seconds']:.1f} s/step, "
                f"{result['samples_per_second']:.2f} samples/s "
                f"(generation {result['generation_seconds']:.1f} s, update {result['update_seconds']:.1f} s per rank; "
                f"mean completion {result['mean_completion_tokens']:.1f} tokens)",
                flush=True,
            )
    base = results[0]
    for result in results[1 : len(args.processes)]:
        ratio = result["samples_per_second"] / base["samples_per_second"]
        print(
            f"scaling {result['processes']}/{base['processes']} processes: samples/s ratio {ratio:.2f} "
            f"(ideal {result['processes'] / base['processes']:.1f})"
        )


if __name__ == "__main__":
    main()
