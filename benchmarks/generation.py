"""Sampling throughput: polo's rollout sampler against Hugging Face `model.generate`, on the CPU.

Same model (polo's built-in SmolLM2-135M-Instruct), same chat-templated prompts, same group size,
length and temperature; each in fp32 and in bf16 autocast. The four cases alternate within every
repetition; the first repetition is a warm-up. Throughput is generated tokens (up to and
including the stop token) per second of wall-clock time; the median over repetitions is reported.
On a shared machine it waits for other processes to go quiet and redoes any measurement during
which they used the CPU.

Then, in the same process, it runs polo's GRPO step of benchmarks/grpo_vs_trl.py (4 prompts x 8,
64 tokens, beta 0.04, polo's defaults) for 1 warm-up + --grpo-steps timed steps, counts the FLOPs
one step actually executes with torch.utils.flop_counter.FlopCounterMode (matmuls and attention,
on an extra step: counting slows it), and reports the achieved FLOP/s of a step, executed FLOPs /
median step time, as a fraction of the bf16 matmul rate measured at the start of the run; beside
it the same for the nominal 10*N*T FLOPs of grpo_vs_trl's compute floor.

Usage:
  python benchmarks/generation.py                       # 8 prompts x 8, 64 tokens, 3 timed reps
  python benchmarks/generation.py --prompts 4 --group-size 8 --reps 5 --grpo-steps 0
The last line printed is (on one line)
  generation polo_vs_hf tokens_per_s_ratio=<polo bf16 / HF bf16>
      grpo_step_matmul_fraction=<executed FLOP/s / matmul rate>
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import matmul_rates, measure_quietly, median, parameter_count, wait_for_quiet

MODEL = "smollm2-135m-instruct"


def hf_generate(model, tokenizer, prompts, group_size, max_new_tokens, temperature, precision, stop_ids):
    """Return the number of generated tokens (through the first stop token) from `model.generate`."""
    from polo.runtime.device import Compute

    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    input_ids = encoded["input_ids"].repeat_interleave(group_size, dim=0)
    attention_mask = encoded["attention_mask"].repeat_interleave(group_size, dim=0)
    with torch.no_grad(), Compute.named(precision).autocast():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=tokenizer.pad_token_id,
        )
    completions = output[:, input_ids.shape[1] :]
    is_stop = torch.isin(completions, torch.tensor(stop_ids))
    lengths = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, completions.shape[1])
    return int(lengths.sum())


def polo_generate(model, tokenizer, prompts, group_size, max_new_tokens, temperature, precision):
    """Return the number of generated tokens from polo's sampler (the one `sampling.sampler: auto` picks on the CPU)."""
    from polo.generation.grouped import pick_sampler
    from polo.generation.rollouts import Decoding
    from polo.runtime.device import Compute

    compute = Compute.named(precision)
    decoding = Decoding(max_new_tokens, temperature=temperature)
    rollouts = pick_sampler("auto", compute)(model, tokenizer, prompts, group_size, decoding, compute=compute)
    return int(rollouts.completion_mask.sum())


def grpo_step_flops(steps: int, out_dir: Path) -> dict:
    """Return timed step seconds, executed FLOPs of one step and tokens of polo's GRPO benchmark step run `steps` + 2
    times."""
    import json

    from torch.utils.flop_counter import FlopCounterMode

    import polo
    import polo.rl.train as trainer_module
    from grpo_vs_trl import polo_config

    def cpu_attention(
        query_shape, key_shape, *args, **kwargs
    ) -> int:  # QK^T and PV (grouped K/V heads count as the query's)
        batch, heads, queries, dim = query_shape
        return 4 * batch * heads * queries * key_shape[2] * dim

    def cpu_attention_backward(grad_out_shape, query_shape, key_shape, *args, **kwargs) -> int:  # dV, dP, dQ, dK
        batch, heads, queries, dim = query_shape
        return 8 * batch * heads * queries * key_shape[2] * dim

    aten = torch.ops.aten
    cpu_flops = {  # FlopCounterMode knows the GPU attention kernels, not the CPU flash kernel
        aten._scaled_dot_product_flash_attention_for_cpu: cpu_attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_attention_backward,
    }
    counted: list[int] = []
    calls = [0]
    original_step = trainer_module.rl_step
    total = steps + 2  # warm-up, timed steps, then one counted step

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == total:
            with FlopCounterMode(display=False, custom_mapping=cpu_flops) as counter:
                result = original_step(*args, **kwargs)
            counted.append(counter.get_total_flops())
            return result
        return original_step(*args, **kwargs)

    trainer_module.rl_step = step
    try:
        polo.train(polo_config(total, out_dir))
    finally:
        trainer_module.rl_step = original_step
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted((row for row in rows if "time/step" in row), key=lambda row: row["step"])
    timed = rows[1 : 1 + steps]
    return {
        "step_times": [row["time/step"] for row in timed],
        "phases": {key: median([row[f"time/{key}"] for row in timed]) for key in ("generation", "reference", "update")},
        "tokens": median([row["tokens_per_second"] * row["time/step"] for row in timed]),
        "executed_flops": counted[0] if counted else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up (default 3)")
    parser.add_argument(
        "--grpo-steps", type=int, default=3, help="timed GRPO steps for the FLOP/s measurement (0: skip; default 3)"
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=900.0,
        help="seconds to wait for other processes to go quiet before measuring (default 900)",
    )
    args = parser.parse_args(argv)

    from polo.config import load_config
    from polo.data import instruction_for, make_task
    from polo.generation.prompts import stop_token_ids
    from polo.models.loading import load_policy
    from polo.rl.batching import batch_rows

    rate_bf16, rate_fp32, rate_packed = matmul_rates(args.max_wait)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"matmul 2048^3 best rate: bf16 {rate_bf16 / 1e9:,.1f} GFLOP/s, fp32 {rate_fp32 / 1e9:,.1f} GFLOP/s, "
        f"fp32 through oneDNN packed {rate_packed / 1e9:,.1f} GFLOP/s"
    )

    config = load_config({"task": {"name": "arithmetic", "answer_in_tags": True, "num_eval": 0}})
    task = make_task(config)
    model, tokenizer = load_policy(MODEL)
    model.eval()
    rows = batch_rows(task.train_rows, 0, args.prompts, config.train.seed)
    prompts = task.prompts(tokenizer, rows, instruction_for(config), config.task.system_prompt)
    stop_ids = stop_token_ids(tokenizer, model)
    print(
        f"{MODEL}: {args.prompts} prompts x {args.group_size} samples, <= {args.max_new_tokens} new tokens, "
        f"temperature {args.temperature}; 1 warm-up + {args.reps} timed reps, cases alternating"
    )

    cases = [(impl, precision) for precision in ("fp32", "bf16") for impl in ("polo", "hf")]
    rates: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    tokens: dict[tuple[str, str], list[int]] = {case: [] for case in cases}
    busiest = 0.0
    wait_for_quiet(args.max_wait)
    for rep in range(args.reps + 1):
        for impl, precision in cases:

            def measure(rep=rep, impl=impl, precision=precision):
                torch.manual_seed(1000 + rep)
                started = time.perf_counter()
                if impl == "polo":
                    count = polo_generate(
                        model, tokenizer, prompts, args.group_size, args.max_new_tokens, args.temperature, precision
                    )
                else:
                    count = hf_generate(
                        model,
                        tokenizer,
                        prompts,
                        args.group_size,
                        args.max_new_tokens,
                        args.temperature,
                        precision,
                        stop_ids,
                    )
                return count, time.perf_counter() - started

            (count, seconds), others = measure_quietly(measure, args.max_wait)
            label = "warm-up" if rep == 0 else f"rep {rep}"
            print(
                f"  {label:<7} {impl:<4} {precision}: {count:5d} tokens in {seconds:6.2f} s = "
                f"{count / seconds:7.1f} tokens/s (other processes {others:.2f} cores)",
                flush=True,
            )
            if rep > 0:
                rates[(impl, precision)].append(count / seconds)
                tokens[(impl, precision)].append(count)
                busiest = max(busiest, others)

    print()
    print(f"{'sampler':<16} {'precision':<9} {'median tokens/s':>15} {'median tokens':>13}")
    for impl, precision in cases:
        name = "polo rollout" if impl == "polo" else "HF generate"
        print(
            f"{name:<16} {precision:<9} {median(rates[(impl, precision)]):>15.1f} "
            f"{median(tokens[(impl, precision)]):>13.0f}"
        )
    fp32_ratio = median(rates[("polo", "fp32")]) / median(rates[("hf", "fp32")])
    bf16_ratio = median(rates[("polo", "bf16")]) / median(rates[("hf", "bf16")])
    print(f"polo/HF tokens/s: fp32 {fp32_ratio:.3f}, bf16 {bf16_ratio:.3f}")
    if busiest > 0.2:
        print(f"WARNING: other processes used up to {busiest:.2f} CPU cores during timed reps; timings are inflated")
    matmul_fraction = float("nan")
    if args.grpo_steps > 0:
        import tempfile

        del model
        wait_for_quiet(args.max_wait)
        with tempfile.TemporaryDirectory(prefix="polo-grpo-flops-") as tmp:
            step = grpo_step_flops(args.grpo_steps, Path(tmp))
        step_time = median(step["step_times"])
        executed = step["executed_flops"] / step_time
        nominal_flops = 10 * parameter_count(MODEL) * step["tokens"]
        matmul_fraction = executed / rate_bf16
        print()
        print(
            f"GRPO step (benchmarks/grpo_vs_trl.py's job, polo defaults): timed steps "
            f"{', '.join(f'{t:.2f}' for t in step['step_times'])} s, median {step_time:.2f} s; "
            + ", ".join(f"{key} {value:.2f} s" for key, value in step["phases"].items())
        )
        print(
            "  executed FLOPs of one step (FlopCounterMode: matmuls + attention) "
            f"{step['executed_flops'] / 1e12:.2f} TFLOP "
            f"-> {executed / 1e9:,.1f} GFLOP/s = {matmul_fraction:.1%} of the bf16 matmul rate"
        )
        print(
            f"  nominal 10*N*T = {nominal_flops / 1e12:.2f} TFLOP (T = {step['tokens']:,.0f} tokens) -> "
            f"{nominal_flops / step_time / 1e9:,.1f} GFLOP/s = {nominal_flops / step_time / rate_bf16:.1%} "
            "of the bf16 matmul rate"
        )
    print(f"generation polo_vs_hf tokens_per_s_ratio={bf16_ratio:.3f} grpo_step_matmul_fraction={matmul_fraction:.3f}")


if __name__ == "__main__":
    main()
