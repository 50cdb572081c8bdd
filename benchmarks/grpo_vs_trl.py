"""GRPO step time and peak memory: polo against TRL on the same job, on the CPU.

The job: SmolLM2-135M-Instruct (polo's built-in default model, the same local directory for
both), 4 arithmetic prompts x 8 completions per step, at most 64 new tokens, temperature 1.0,
beta = 0.04 (so a reference model is kept), mu = 1 (one pass, no old log-probs), rewards
`correct` + `r1_format` (weight 1 each), full fine-tuning with AdamW at lr 1e-6. Both trainers
see exactly the same prompt strings (polo's chat-templated prompts, given to TRL as plain text,
which TRL tokenizes without templating again) in the same order.

Runs, each in its own subprocess so peak RSS is per run:
  polo      polo's defaults (precision "auto": on a CPU with native bf16, bf16 weights with fp32
            master weights and AdamW state, see polo.models.precision)
  trl_fast  TRL GRPOTrainer, bf16 autocast, no gradient checkpointing (its fastest)
  trl_lean  TRL GRPOTrainer, fp32, gradient checkpointing (its leanest)
  polo_lora polo's defaults with LoRA adapters (r=16, alpha=32, every linear layer but the LM head)
  trl_lora  TRL GRPOTrainer with the same peft LoRA adapters, bf16 autocast, no gradient checkpointing
(`--only ... trl_default` adds TRL's own defaults, bf16 autocast + gradient checkpointing.)
The LoRA runs are reported beside the full fine-tuning ones; the ratios on the last line compare
full fine-tuning only. They alternate (polo, trl_fast, trl_lean, polo_lora, trl_lora, repeated
--rounds times). The first step of every run
is a warm-up and is dropped; the step time is the median over the remaining steps of all rounds.
Peak RSS is ru_maxrss as of the end of the last step (polo writes a final checkpoint after it;
TRL, with saving off, does not). On a shared machine the script waits for other processes to go
quiet before each run and runs again any run during which they used the CPU (--retries).

The compute floor is FLOPs / rate with FLOPs = (6 + 2 + 2) * N * T per step (policy update,
reference forward, sampling), N the parameter count, T the prompt + completion tokens of the
step's 32 sequences (median over polo's timed steps), and rate the best measured bf16 2048^3
matmul rate on this machine.

Usage:
  python benchmarks/grpo_vs_trl.py                   # 1 round, 4 steps per run (1 warm-up + 3 timed)
  python benchmarks/grpo_vs_trl.py --rounds 2 --steps 5
  python benchmarks/grpo_vs_trl.py --only polo --steps 2   # quick check of a subset
Needs the `bench` extra (`pip install -e ".[bench]"`, TRL 1.16.0) for the TRL runs.
The last line printed is
  polo_vs_trl step_time_ratio=... peak_rss_ratio=... floor_fraction=...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ForeignLoad, matmul_rates, median, mib, peak_rss_bytes, wait_for_quiet  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROMPTS_PER_STEP = 4
GROUP_SIZE = 8
MAX_NEW_TOKENS = 64
TEMPERATURE = 1.0
BETA = 0.04
LEARNING_RATE = 1e-6
LORA = {"r": 16, "alpha": 32.0}  # on every linear layer but the LM head (polo's and peft's "all-linear")
FULL_RUNS = ("polo", "trl_fast", "trl_lean")
LORA_RUNS = ("polo_lora", "trl_lora")
RUNS = FULL_RUNS + LORA_RUNS
EXTRA_RUNS = ("trl_default",)  # only with --only: TRL's own defaults, bf16 autocast + gradient checkpointing
TRL_SETTINGS = {  # run -> (bf16 autocast, gradient checkpointing)
    "trl_fast": (True, False),
    "trl_lean": (False, True),
    "trl_default": (True, True),
    "trl_lora": (True, False),
}
DESCRIPTIONS = {
    "polo": "polo defaults (precision auto)",
    "trl_fast": "TRL bf16, no grad ckpt",
    "trl_lean": "TRL fp32, grad ckpt",
    "trl_default": "TRL bf16, grad ckpt (defaults)",
    "polo_lora": "polo defaults, LoRA r=16",
    "trl_lora": "TRL bf16, no ckpt, LoRA r=16",
}


def polo_config(steps: int, output_dir: Path, lora: bool = False) -> dict:
    """Return the polo run configuration (a mapping of config sections); `lora` adds the LoRA adapters."""
    return {
        "model": {"name": MODEL, **({"lora": dict(LORA)} if lora else {})},
        "task": {"name": "arithmetic", "min_digits": 2, "max_digits": 2, "answer_in_tags": True, "num_eval": 0},
        "rewards": {"correct": 1.0, "r1_format": 1.0},
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS},
        "algorithm": {"group_size": GROUP_SIZE, "beta": BETA, "update_epochs": 1},
        "train": {"steps": steps, "prompts_per_step": PROMPTS_PER_STEP, "learning_rate": LEARNING_RATE, "precision": "auto"},
        "eval": {"before": False, "after": False},
        "output": {"dir": str(output_dir), "save_every": 0, "tensorboard": False, "plots": False, "progress": False},
    }


def trl_micro_batch(config, requested: int | None = None) -> int:
    """Return TRL's per-device batch: `requested`, else polo's micro-batch size, as a divisor of the step's sequences."""
    sequences = PROMPTS_PER_STEP * GROUP_SIZE
    size = max(min(requested or config.train.micro_batch_size, sequences), 1)
    while sequences % size:
        size -= 1
    return size


def step_prompts(config, tokenizer, steps: int):
    """Return (task, rows, prompt strings) that polo trains on in steps 1..steps, in order."""
    from polo.data import instruction_for, make_task
    from polo.rl.batching import batch_rows

    task = make_task(config)
    rows = [
        row
        for step in range(steps)
        for row in batch_rows(task.train_rows, step, config.train.prompts_per_step, config.train.seed)
    ]
    prompts = task.prompts(tokenizer, rows, instruction_for(config), config.task.system_prompt)
    return task, rows, prompts


# ----------------------------------------------------------------------------------------------
# children


def run_polo(steps: int, out_dir: Path, lora: bool = False) -> dict:
    import polo
    import polo.rl.train as trainer_module
    from polo.config import load_config
    from polo.models.loading import ensure_builtin_model
    from polo.runtime.device import resolve_train_precision
    from transformers import AutoTokenizer

    config_dict = polo_config(steps, out_dir / "run", lora)
    config = load_config(config_dict)

    # Prompt tokens per step (for T when the metrics do not give it).
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin_model(MODEL)))
    _, _, prompts = step_prompts(config, tokenizer, steps)
    prompt_lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    prompt_tokens = [
        GROUP_SIZE * sum(prompt_lengths[s * PROMPTS_PER_STEP : (s + 1) * PROMPTS_PER_STEP]) for s in range(steps)
    ]
    del tokenizer

    # Peak RSS as of the end of each step (polo saves a final checkpoint after the last step,
    # which TRL with saving off does not; this keeps the comparison to training itself).
    rss_after_step: list[int] = []
    original_step = getattr(trainer_module, "rl_step", None)
    if original_step is not None:

        def measured_step(*args, **kwargs):
            result = original_step(*args, **kwargs)
            rss_after_step.append(peak_rss_bytes())
            return result

        trainer_module.rl_step = measured_step

    polo.train(config_dict)

    rows = [json.loads(line) for line in (out_dir / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted((row for row in rows if "time/step" in row), key=lambda row: row["step"])
    if all("timestamp" in row for row in rows):
        times = [rows[0]["time/step"]] + [b["timestamp"] - a["timestamp"] for a, b in zip(rows, rows[1:])]
        time_source = "metrics timestamp differences"
    else:
        times = [row["time/step"] for row in rows]
        time_source = "metrics time/step"
    tokens, token_source = [], None
    for index, row in enumerate(rows):
        if "tokens" in row:
            tokens.append(float(row["tokens"]))
            token_source = "metrics tokens"
        elif "tokens_per_second" in row:
            tokens.append(round(row["tokens_per_second"] * row["time/step"]))
            token_source = "metrics tokens_per_second x time/step"
        else:
            tokens.append(row["completion_length/mean"] * PROMPTS_PER_STEP * GROUP_SIZE + prompt_tokens[index])
            token_source = "completion_length/mean x 32 + prompt tokens"
    return {
        "precision": resolve_train_precision(config),
        "gradient_checkpointing": getattr(config.train, "gradient_checkpointing", False),
        "micro_batch": config.train.micro_batch_size,
        "step_times": times,
        "time_source": time_source,
        "phase_times": {key: [row.get(f"time/{key}") for row in rows] for key in ("generation", "reward", "reference", "update")},
        "completion_length": [row["completion_length/mean"] for row in rows],
        "tokens": tokens,
        "token_source": token_source,
        "peak_rss_train": rss_after_step[-1] if rss_after_step else None,
    }


def run_trl(variant: str, steps: int, out_dir: Path, requested_micro_batch: int | None = None) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory; never ask a hub
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polo.config import load_config
    from polo.models.loading import ensure_builtin_model
    from polo.rewards import r1_format

    model_dir = str(ensure_builtin_model(MODEL))
    config = load_config(polo_config(steps, out_dir / "unused"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task, rows, prompts = step_prompts(config, tokenizer, steps)
    polo_prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]  # what polo's sampler feeds the model
    del tokenizer
    # Plain-text prompts (already chat-templated by polo): TRL only tokenizes them, like polo.
    dataset = Dataset.from_dict({"prompt": prompts, "row_index": list(range(len(rows)))})

    def correct(completions, row_index, **kwargs):
        return [task.correctness(text, rows[index]) for text, index in zip(completions, row_index)]

    def r1_format_reward(completions, row_index, **kwargs):
        return [r1_format(text, rows[index]) for text, index in zip(completions, row_index)]

    bf16, checkpointing = TRL_SETTINGS[variant]
    micro_batch = trl_micro_batch(config, requested_micro_batch)  # by default the same as polo's
    args = GRPOConfig(
        output_dir=str(out_dir / "run"),
        max_steps=steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=PROMPTS_PER_STEP * GROUP_SIZE // micro_batch,
        generation_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,  # one generation per optimizer step
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        beta=BETA,
        num_iterations=1,
        learning_rate=LEARNING_RATE,
        bf16=bf16,
        gradient_checkpointing=checkpointing,
        use_cpu=True,
        shuffle_dataset=False,  # keep polo's prompt order
        seed=0,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.first_begin = None
            self.ends: list[float] = []
            self.rss: list[int] = []
            self.lengths: list[float] = []
            self.trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first_begin is None:
                self.first_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            self.rss.append(peak_rss_bytes())
            lengths = self.trainer._metrics["train"].get("completions/mean_length") if self.trainer else None
            self.lengths.append(lengths[-1] if lengths else float("nan"))

    timer = StepTimer()
    peft_config = None
    if variant == "trl_lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[correct, r1_format_reward],
        args=args,
        train_dataset=dataset,
        callbacks=[timer],
        peft_config=peft_config,
    )
    timer.trainer = trainer
    # TRL tokenizes plain-text prompts itself (no chat template); check it sees polo's exact tokens.
    same_prompt_tokens = trainer.processing_class(text=prompts)["input_ids"] == polo_prompt_ids
    if not same_prompt_tokens:
        print("WARNING: TRL tokenizes the prompts differently from polo", flush=True)
    trainer.train()
    times = [timer.ends[0] - timer.first_begin] + [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    return {
        "precision": "bf16" if bf16 else "fp32",
        "gradient_checkpointing": checkpointing,
        "micro_batch": micro_batch,
        "step_times": times,
        "time_source": "TrainerCallback on_step_end differences",
        "same_prompt_tokens": same_prompt_tokens,
        "completion_length": timer.lengths,
        "peak_rss_train": timer.rss[-1] if timer.rss else None,
    }


def child_main(args) -> None:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    foreign = ForeignLoad()
    if args.child.startswith("polo"):
        result = run_polo(args.steps, out_dir, lora=args.child == "polo_lora")
    else:
        result = run_trl(args.child, args.steps, out_dir, args.trl_micro_batch)
    import torch

    result.update(
        run=args.child,
        peak_rss=peak_rss_bytes(),
        wall=time.perf_counter() - started,
        threads=torch.get_num_threads(),
        foreign_cores=foreign.cores(),
    )
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))


# ----------------------------------------------------------------------------------------------
# parent


def parameter_count() -> int:
    """Return N, the number of distinct parameters of the model (tied embeddings counted once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from polo.models.loading import ensure_builtin_model

    config = AutoConfig.from_pretrained(str(ensure_builtin_model(MODEL)))
    with torch.device("meta"):  # shapes only: nothing is allocated or read
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def run_child(name: str, steps: int, out_dir: Path, trl_micro_batch: int | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").unlink(missing_ok=True)  # a retry must not read an earlier attempt's result
    log_path = out_dir / "child.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--steps", str(steps), "--out", str(out_dir)]
    if trl_micro_batch:
        command += ["--trl-micro-batch", str(trl_micro_batch)]
    started = time.perf_counter()
    with log_path.open("w") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
    if code != 0 or not (out_dir / "result.json").exists():
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        raise SystemExit(f"{name} run failed (exit {code}); last lines of {log_path}:\n{tail}")
    result = json.loads((out_dir / "result.json").read_text())
    result["process_wall"] = time.perf_counter() - started
    return result


def fmt(value: float, spec: str = ".3f") -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_phase_medians(name: str, runs: list[dict]) -> None:
    """Print the median time of each phase of a polo run over its timed steps (all rounds)."""
    phases = runs[0].get("phase_times", {})
    if phases:
        print(f"{name} phase medians (timed steps): " + ", ".join(
            f"{key} {median([v for r in runs for v in r['phase_times'][key][1:] if v is not None]):.2f} s" for key in phases
        ))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is a warm-up (default 4)")
    parser.add_argument("--rounds", type=int, default=1, help="times to repeat the alternating runs (default 1)")
    parser.add_argument("--only", nargs="+", choices=RUNS + EXTRA_RUNS, default=list(RUNS),
                        help="run only these (trl_default, TRL's own bf16 + gradient checkpointing defaults, runs only when named)")
    parser.add_argument("--out", default=None, help="where runs write (default: a new temporary directory)")
    parser.add_argument("--max-wait", type=float, default=900.0,
                        help="seconds to wait for other processes to go quiet before each measurement (default 900)")
    parser.add_argument("--retries", type=int, default=2,
                        help="times to redo a run during which other processes used the CPU (default 2)")
    parser.add_argument("--trl-micro-batch", type=int, default=None,
                        help="TRL's per_device_train_batch_size (default: polo's train.micro_batch_size); "
                        "gradient accumulation makes up the 32 sequences of a step")
    parser.add_argument("--child", choices=RUNS + EXTRA_RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args)
        return
    if args.steps < 2:
        parser.error("--steps must be at least 2 (one warm-up step is dropped)")

    import torch

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="polo-vs-trl-"))
    order = [name for name in RUNS + EXTRA_RUNS if name in args.only]
    print(f"polo vs TRL GRPO step on {MODEL}: {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} completions, "
          f"<= {MAX_NEW_TOKENS} new tokens, T={TEMPERATURE}, beta={BETA}, mu=1, rewards correct + r1_format")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} round(s) of {order}, "
          f"{args.steps} steps per run (first dropped); output in {root}", flush=True)
    try:
        import trl

        print(f"trl {trl.__version__}", flush=True)
    except ImportError:
        if any(name.startswith("trl") for name in order):
            raise SystemExit('TRL is not installed: pip install -e ".[bench]"')

    # Measure the machine first, while nothing else runs.
    rate_bf16, rate_fp32 = matmul_rates(args.max_wait)
    print(f"matmul 2048^3 best rate: bf16 {rate_bf16 / 1e9:,.1f} GFLOP/s, fp32 {rate_fp32 / 1e9:,.1f} GFLOP/s", flush=True)

    results: dict[str, list[dict]] = {name: [] for name in order}
    for round_index in range(args.rounds):
        for name in order:
            for attempt in range(args.retries + 1):
                wait_for_quiet(args.max_wait)
                print(f"round {round_index + 1}/{args.rounds}: {name} ...", flush=True)
                result = run_child(name, args.steps, root / f"round{round_index + 1}-{name}", args.trl_micro_batch)
                if result["foreign_cores"] < 0.2 or attempt == args.retries:
                    break
                print(f"  other processes used {result['foreign_cores']:.2f} CPU cores during that run "
                      f"(steps {', '.join(f'{t:.1f}' for t in result['step_times'])} s); running it again", flush=True)
            results[name].append(result)
            timed = result["step_times"][1:]
            print(
                f"  {name}: steps {', '.join(f'{t:.2f}' for t in result['step_times'])} s "
                f"(first is warm-up), median {median(timed):.2f} s, peak RSS {mib(result['peak_rss'])}, "
                f"process {result['process_wall']:.0f} s, other processes {result['foreign_cores']:.2f} cores",
                flush=True,
            )

    print()
    header = f"{'run':<11} {'setting':<31} {'round':>5} {'median step':>11} {'timed steps (s)':<22} {'mean len':>8} {'peak RSS train':>14} {'peak RSS proc':>13} {'others':>6}"
    print(header)
    print("-" * len(header))
    summary = {}
    for name in order:
        all_timed, peaks_train, peaks = [], [], []
        for round_index, result in enumerate(results[name]):
            timed = result["step_times"][1:]
            all_timed += timed
            train_peak = result.get("peak_rss_train") or result["peak_rss"]
            peaks_train.append(train_peak)
            peaks.append(result["peak_rss"])
            lengths = [x for x in result["completion_length"][1:] if x == x]
            print(
                f"{name:<11} {DESCRIPTIONS[name]:<31} {round_index + 1:>5} {median(timed):>10.2f}s "
                f"{', '.join(f'{t:.1f}' for t in timed):<22} {fmt(sum(lengths) / len(lengths) if lengths else float('nan'), '.1f'):>8} "
                f"{mib(train_peak):>14} {mib(result['peak_rss']):>13} {result['foreign_cores']:>6.2f}"
            )
        summary[name] = {"median": median(all_timed), "peak_train": max(peaks_train), "peak": max(peaks)}
    print()
    for name in order:
        s = summary[name]
        print(f"{name:<11} median step {s['median']:.2f} s over {args.rounds} round(s); peak RSS {mib(s['peak_train'])} "
              f"at the last step, {mib(s['peak'])} whole process")

    step_ratio = rss_ratio = floor_fraction = float("nan")
    trl_runs = [name for name in order if name in FULL_RUNS and name.startswith("trl")]
    if "polo" in summary:
        polo_median = summary["polo"]["median"]
        polo_timed_tokens = [t for result in results["polo"] for t in result["tokens"][1:]]
        tokens = median(polo_timed_tokens)
        n_params = parameter_count()
        flops = (6 + 2 + 2) * n_params * tokens
        floor = flops / rate_bf16
        floor_fraction = floor / polo_median
        source = results["polo"][0]["token_source"]
        print(
            f"compute floor: N = {n_params:,} parameters, T = {tokens:,.0f} tokens per step (median of polo's timed steps; "
            f"{source}), 10*N*T = {flops / 1e12:.2f} TFLOP at {rate_bf16 / 1e9:,.1f} GFLOP/s bf16 = {floor:.2f} s "
            f"= {floor_fraction:.1%} of polo's median step"
        )
        first = results["polo"][0]
        print(f"polo settings: precision {first['precision']}, gradient checkpointing {first['gradient_checkpointing']}, "
              f"micro-batch {first['micro_batch']}; step time from {first['time_source']}")
        print_phase_medians("polo", results["polo"])
        if trl_runs:
            fastest = min(trl_runs, key=lambda name: summary[name]["median"])
            leanest = min(trl_runs, key=lambda name: summary[name]["peak_train"])
            step_ratio = summary[fastest]["median"] / polo_median
            rss_ratio = summary["polo"]["peak_train"] / summary[leanest]["peak_train"]
            same = all(r.get("same_prompt_tokens") for name in trl_runs for r in results[name])
            print(f"TRL prompt tokens identical to polo's: {same}; TRL micro-batch "
                  f"{results[trl_runs[0]][0]['micro_batch']} x {PROMPTS_PER_STEP * GROUP_SIZE // results[trl_runs[0]][0]['micro_batch']} accumulation steps")
            print(f"TRL fastest: {fastest} ({summary[fastest]['median']:.2f} s); TRL lowest peak: {leanest} "
                  f"({mib(summary[leanest]['peak_train'])}); peak RSS compared at the end of the last step")
    lora_runs = [name for name in LORA_RUNS if name in summary]
    if lora_runs:
        print("LoRA beside (r=16 on every linear layer; not in the ratios below): " + "; ".join(
            f"{name} {summary[name]['median']:.2f} s, {mib(summary[name]['peak_train'])}" for name in lora_runs
        ) + (f"; trl_lora / polo_lora step time {summary['trl_lora']['median'] / summary['polo_lora']['median']:.3f}, "
             f"peak RSS {summary['polo_lora']['peak_train'] / summary['trl_lora']['peak_train']:.3f}" if len(lora_runs) == 2 else ""))
        if "polo_lora" in results:
            print_phase_medians("polo_lora", results["polo_lora"])
    busy = [f"{name} round {i + 1} ({r['foreign_cores']:.2f} cores)" for name in order for i, r in enumerate(results[name]) if r["foreign_cores"] > 0.2]
    if busy:
        print("WARNING: other processes used the CPU during " + ", ".join(busy) + "; those timings are inflated")
    print(f"polo_vs_trl step_time_ratio={fmt(step_ratio)} peak_rss_ratio={fmt(rss_ratio)} floor_fraction={fmt(floor_fraction)}")


if __name__ == "__main__":
    main()
