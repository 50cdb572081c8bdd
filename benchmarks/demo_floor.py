"""How close a finished GRPO run came to its compute floor: by default `make demo`'s run, runs/grpo_arith.

The floor is the least work a step needs, at the best rate this machine offers, as in
benchmarks/grpo_vs_trl.py:
- T, the step's `floor_tokens` metric: each group's prompt once (the opening all its prompts share
  once), and the completions;
- (2 sampling + 6 x update epochs + 2 reference scoring where beta > 0) x N x T FLOPs, N the model's
  parameters (tied embeddings once);
- at the fastest of the bf16, fp32 and oneDNN-packed fp32 2048^3 matmul rates, measured now, on a
  quiet machine. Run it on the machine that ran the job, with nothing else running.

The step time is the median of `time/step` over the steps after the first (a warm-up). A fraction
above 1 would be a bug in the floor.

Usage:
  python benchmarks/demo_floor.py [RUN_DIR]
The last line printed is
  demo floor_fraction=<floor / median step> median_step_s=<s> floor_s=<s>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import matmul_rates, median, parameter_count


def step_rows(run_dir: Path) -> list[dict]:
    """Return the metrics rows of `run_dir`'s training steps (those with a step time and floor tokens)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"demo_floor: {metrics} does not exist: give the output directory of a finished `polo train`")
    rows = []
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise SystemExit(f"demo_floor: {metrics} line {number} is not JSON ({error.msg})") from None
        if "time/step" in row and "floor_tokens" in row:
            rows.append(row)
    if len(rows) < 2:
        raise SystemExit(
            f"demo_floor: {metrics} holds {len(rows)} step(s) with floor_tokens; the floor needs two or more"
        )
    return rows


def floor_multiplier(config: dict) -> int:
    """Return the FLOPs per parameter and floor token of a step: 2 to sample, 6 per update epoch, 2 for a reference."""
    algorithm = config.get("algorithm", {})
    return 2 + 6 * int(algorithm.get("update_epochs", 1)) + (2 if float(algorithm.get("beta", 0.0)) > 0 else 0)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="runs/grpo_arith", type=Path)
    parser.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for the machine to go quiet")
    args = parser.parse_args(argv)
    if args.max_wait < 0:
        raise SystemExit(f"demo_floor: --max-wait must be 0 or more seconds, got {args.max_wait}")
    config_path = args.run_dir / "config.yaml"
    if not config_path.is_file():
        raise SystemExit(
            f"demo_floor: {config_path} does not exist: give the output directory of a finished `polo train`"
        )
    try:
        config = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError as error:
        raise SystemExit(f"demo_floor: {config_path} is not YAML ({error})") from None
    model = (config.get("model") or {}).get("name") if isinstance(config, dict) else None
    if not model:
        raise SystemExit(f"demo_floor: {config_path} names no model.name: is it a `polo train` run's config?")
    timed = step_rows(args.run_dir)[1:]
    step_time = median([row["time/step"] for row in timed])
    tokens = median([row["floor_tokens"] for row in timed])
    n_params = parameter_count(model)
    multiplier = floor_multiplier(config)
    rate_bf16, rate_fp32, rate_packed = matmul_rates(args.max_wait)
    best_rate, best_dtype = max((rate_bf16, "bf16"), (rate_fp32, "fp32"), (rate_packed, "fp32 oneDNN-packed"))
    floor = multiplier * n_params * tokens / best_rate
    phases = ", ".join(
        f"{name} {median([row.get(f'time/{name}', 0.0) for row in timed]):.2f} s"
        for name in ("generation", "reference", "update")
    )
    print(f"{args.run_dir}: {len(timed)} timed steps, median step {step_time:.2f} s ({phases})")
    print(
        f"compute floor: N = {n_params:,} parameters, T = {tokens:,.0f} tokens per step (median), "
        f"{multiplier}*N*T = {multiplier * n_params * tokens / 1e12:.2f} TFLOP at {best_dtype} "
        f"{best_rate / 1e9:,.1f} GFLOP/s (bf16 {rate_bf16 / 1e9:,.1f}, fp32 {rate_fp32 / 1e9:,.1f}, "
        f"fp32 oneDNN-packed {rate_packed / 1e9:,.1f}) = {floor:.2f} s"
    )
    fraction = floor / step_time
    print(f"demo floor_fraction={fraction:.3f} median_step_s={step_time:.2f} floor_s={floor:.2f}")
    return fraction


if __name__ == "__main__":
    main()
