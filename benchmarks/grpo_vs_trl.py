"""GRPO step time and peak memory: polo against TRL on the same job, on the CPU (or one GPU, --device cuda).

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
reference forward, sampling), N the parameter count, T the least tokens the step needs: each
group's prompt once (the shared-prompt layout), the opening all its prompts share (the chat
template's system prompt) once, plus the completions of its 32 sequences (median
over polo's timed steps), and rate the faster of the measured bf16 and fp32 2048^3 matmul rates
on this machine (both are printed, with the precision each trainer used). The rates are measured
before the runs and again after them, and the floor takes the higher of the two: a shared VM's
speed drifts (by ~15 % within an hour on a 2-core EPYC), and the second probe shows by how much. A 400 MiB
copy is timed beside each probe: a run can slow down with the matmul rate unchanged (2-core EPYC, family 25:
the same code took 11.1 and 13.3 s a step with probes of 405-416 GFLOP/s), and the copy rate is the first thing to
compare then.

Usage:
  python benchmarks/grpo_vs_trl.py                   # 1 round, 4 steps per run (1 warm-up + 3 timed)
  python benchmarks/grpo_vs_trl.py --rounds 2 --steps 5
  python benchmarks/grpo_vs_trl.py --only polo --steps 2   # quick check of a subset
Needs the `bench` extra (`pip install -e ".[bench]"`, TRL 1.16.0) for the TRL runs.
Each finished comparison appends its figures, with the date, commit, machine and command, to
benchmarks/results/grpo_vs_trl.jsonl; `python benchmarks/report.py` then writes docs/benchmarks.md.
The last line printed is
  polo_vs_trl step_time_ratio=... peak_rss_ratio=... floor_fraction=...

On a GPU (`--device cuda`, docs/gpu.md) the same job runs on the GPU:
  polo      polo's defaults with train.device=cuda (precision auto)
  trl_gpu   TRL GRPOTrainer, bf16 (mixed precision), no gradient checkpointing, no vLLM
alternating for --rounds; each run's first step is a warm-up and is dropped, and memory is the
peak `torch.cuda.max_memory_allocated` as of the end of each run's last step. With
`--accuracy-steps N` both also train the demo recipe (recipes/grpo_arith.yaml) for N steps on the
GPU, and `polo eval` scores the base model and each trained one greedily on its held-out
problems. The last line printed is then
  polo_vs_trl_gpu step_time_ratio=<TRL/polo> gpu_memory_ratio=<polo/TRL>
  python benchmarks/grpo_vs_trl.py --device cuda --steps 6 --rounds 2 --accuracy-steps 40
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    ForeignLoad,
    copy_rate,
    matmul_rates,
    median,
    mib,
    parameter_count,
    peak_rss_bytes,
    record_result,
    wait_for_quiet,
)

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
GPU_RUNS = ("polo", "trl_gpu")  # --device cuda
DEMO_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_arith.yaml"
EXTRA_RUNS = ("trl_default",)  # only with --only: TRL's own defaults, bf16 autocast + gradient checkpointing
TRL_SETTINGS = {  # run -> (bf16 autocast, gradient checkpointing)
    "trl_fast": (True, False),
    "trl_lean": (False, True),
    "trl_default": (True, True),
    "trl_lora": (True, False),
    "trl_gpu": (True, False),
}
DESCRIPTIONS = {
    "polo": "polo defaults (precision auto)",
    "trl_fast": "TRL bf16, no grad ckpt",
    "trl_lean": "TRL fp32, grad ckpt",
    "trl_default": "TRL bf16, grad ckpt (defaults)",
    "polo_lora": "polo defaults, LoRA r=16",
    "trl_lora": "TRL bf16, no ckpt, LoRA r=16",
    "trl_gpu": "TRL bf16 on the GPU, no grad ckpt",
}


def polo_config(steps: int, output_dir: Path, lora: bool = False, device: str = "cpu") -> dict:
    """Return the polo run configuration (a mapping of config sections); `lora` adds the LoRA adapters."""
    return {
        "model": {"name": MODEL, **({"lora": dict(LORA)} if lora else {})},
        "task": {"name": "arithmetic", "min_digits": 2, "max_digits": 2, "answer_in_tags": True, "num_eval": 0},
        "rewards": {"correct": 1.0, "r1_format": 1.0},
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS},
        "algorithm": {"group_size": GROUP_SIZE, "beta": BETA, "update_epochs": 1},
        "train": {
            "steps": steps,
            "prompts_per_step": PROMPTS_PER_STEP,
            "learning_rate": LEARNING_RATE,
            "precision": "auto",
            "device": device,
        },
        "eval": {"before": False, "after": False},
        "output": {"dir": str(output_dir), "save_every": 0, "report_to": [], "plots": False, "progress": False},
    }


def demo_config(steps: int, output_dir: Path, device: str) -> dict:
    """Return the demo recipe's configuration (recipes/grpo_arith.yaml) for `steps` steps on `device`, evaluated
    afterwards by `polo eval`."""
    import yaml

    config = yaml.safe_load(DEMO_RECIPE.read_text())
    config["train"].update(steps=steps, device=device)
    config["eval"] = {**config.get("eval", {}), "before": False, "after": False}
    config["output"] = {
        "dir": str(output_dir),
        "save_every": 0,
        "report_to": [],
        "plots": False,
        "progress": False,
    }
    return config


def job_config(job: str, steps: int, output_dir: Path, lora: bool = False, device: str = "cpu") -> dict:
    """Return the polo configuration of a job: "bench" (this benchmark's) or "demo" (the demo recipe)."""
    return demo_config(steps, output_dir, device) if job == "demo" else polo_config(steps, output_dir, lora, device)


def trl_micro_batch(config, requested: int | None = None) -> int:
    """Return TRL's per-device batch: `requested`, else polo's micro-batch size, as a divisor of the step's
    sequences."""
    sequences = config.train.prompts_per_step * config.algorithm.group_size
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


def least_prompt_tokens(prompts: list[list[int]]) -> int:
    """Return the prompt tokens a step must run: every prompt's own, the prefix they all open with counted once."""
    shared = len(os.path.commonprefix(prompts)) if len(prompts) > 1 else 0
    return sum(len(ids) for ids in prompts) - (len(prompts) - 1) * shared


def run_polo(steps: int, out_dir: Path, lora: bool = False, device: str = "cpu", job: str = "bench") -> dict:
    from transformers import AutoTokenizer

    import polo
    import polo.rl.train as trainer_module
    from polo.config import load_config
    from polo.models.loading import ensure_builtin_model
    from polo.runtime.device import train_compute

    config_dict = job_config(job, steps, out_dir / "run", lora, device)
    config = load_config(config_dict)
    prompts_per_step, group_size = config.train.prompts_per_step, config.algorithm.group_size

    # Prompt tokens per step (for T when the metrics do not give it).
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin_model(MODEL)))
    _, _, prompts = step_prompts(config, tokenizer, steps)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    prompt_lengths = [len(ids) for ids in prompt_ids]
    prompt_tokens = [
        group_size * sum(prompt_lengths[s * prompts_per_step : (s + 1) * prompts_per_step]) for s in range(steps)
    ]
    # The least work: each group's prompt once (the shared-prompt layout), the opening all the step's prompts
    # share (the chat template's system prompt) once, then the completions (polo.rl.step.least_tokens).
    shared_prompt_tokens = [
        least_prompt_tokens(prompt_ids[s * prompts_per_step : (s + 1) * prompts_per_step]) for s in range(steps)
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
    compute = train_compute(config)  # as the run resolved it (after it, so the run starts CUDA itself)

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
            tokens.append(row["completion_length/mean"] * prompts_per_step * group_size + prompt_tokens[index])
            token_source = "completion_length/mean x 32 + prompt tokens"
    return {
        "precision": compute.precision,
        "device": str(compute.device),
        "gradient_checkpointing": getattr(config.train, "gradient_checkpointing", False),
        "micro_batch": config.train.micro_batch_size,
        "step_times": times,
        "time_source": time_source,
        "phase_times": {
            key: [row.get(f"time/{key}") for row in rows] for key in ("generation", "reward", "reference", "update")
        },
        "completion_length": [row["completion_length/mean"] for row in rows],
        "tokens": tokens,
        "token_source": token_source,
        "floor_tokens": [
            row["completion_length/mean"] * prompts_per_step * group_size + shared_prompt_tokens[index]
            for index, row in enumerate(rows)
        ],
        "peak_rss_train": rss_after_step[-1] if rss_after_step else None,
        "peak_gpu_train": gpu_peak(rows),
        "final_model": str(max((out_dir / "run" / "checkpoints").glob("step-*"), default="")),
    }


def trl_arguments(
    config, variant: str, micro_batch: int, output_dir: Path, device: str, job: str, reward_weights: list[float]
):
    """Return TRL's GRPOConfig for polo's `config` (same batch, sampling, KL and learning rate; the demo's schedule
    too)."""
    from trl import GRPOConfig

    bf16, checkpointing = TRL_SETTINGS[variant]
    sequences = config.train.prompts_per_step * config.algorithm.group_size
    schedule = {}
    if job == "demo":  # the demo recipe's warm-up then constant rate (the step-time job keeps TRL's default schedule)
        kind = config.train.lr_schedule
        schedule = {
            "warmup_steps": config.train.warmup_steps,
            "lr_scheduler_type": "constant_with_warmup" if kind == "constant" else kind,
        }
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=config.train.steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=sequences // micro_batch,
        generation_batch_size=sequences,  # one generation per optimizer step
        num_generations=config.algorithm.group_size,
        max_completion_length=config.sampling.max_new_tokens,
        temperature=config.sampling.temperature,
        beta=config.algorithm.beta,
        num_iterations=1,
        learning_rate=config.train.learning_rate,
        bf16=bf16,
        gradient_checkpointing=checkpointing,
        use_cpu=device == "cpu",
        shuffle_dataset=False,  # keep polo's prompt order
        seed=0,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        reward_weights=reward_weights,
        **schedule,
    )


def trl_rewards(config, task, rows) -> tuple[list, list[float]]:
    """Return (TRL reward functions, their weights) for polo's configured rewards, scored by polo's own checkers."""
    from polo.rewards import r1_format

    checkers = {"correct": task.correctness, "r1_format": r1_format}
    unknown = sorted(set(config.rewards) - set(checkers))
    if unknown:
        raise SystemExit(f"the TRL side knows the rewards {sorted(checkers)}, not {unknown}")
    functions = []
    for name in config.rewards:

        def reward(completions, row_index, _checker=checkers[name], **kwargs):
            return [_checker(text, rows[index]) for text, index in zip(completions, row_index)]

        reward.__name__ = name
        functions.append(reward)
    return functions, [float(weight) for weight in config.rewards.values()]


class StepTimer:
    """A TRL TrainerCallback's hooks: the time, peak RSS, peak GPU memory and mean completion length at each step's
    end."""

    def __init__(self, device: str):
        self.device = device
        self.first_begin = None
        self.ends: list[float] = []
        self.rss: list[int] = []
        self.gpu: list[int] = []
        self.lengths: list[float] = []
        self.trainer = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_begin is None:
            self.first_begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        import torch

        if self.device != "cpu":
            torch.cuda.synchronize()  # the step's kernels belong to its time
            self.gpu.append(torch.cuda.max_memory_allocated())
        self.ends.append(time.perf_counter())
        self.rss.append(peak_rss_bytes())
        lengths = self.trainer._metrics["train"].get("completions/mean_length") if self.trainer else None
        self.lengths.append(lengths[-1] if lengths else float("nan"))


def step_timer(device: str):
    """Return a StepTimer that TRL's Trainer takes as a callback."""
    from transformers import TrainerCallback

    class TrlStepTimer(StepTimer, TrainerCallback):
        pass

    return TrlStepTimer(device)


def gpu_peak(rows: list[dict]) -> int | None:
    """Return the run's peak `torch.cuda.max_memory_allocated` in bytes from polo's metrics rows (None off CUDA).

    polo logs each step's peak and resets the counter (`gpu_max_memory_allocated_gib`), so the
    run's peak over its steps is the largest of them; the final checkpoint, written after the
    last step, is not counted (as TRL, with saving off, writes none).
    """
    peaks = [row["gpu_max_memory_allocated_gib"] for row in rows if "gpu_max_memory_allocated_gib" in row]
    return round(max(peaks) * 2**30) if peaks else None


def run_trl(
    variant: str,
    steps: int,
    out_dir: Path,
    requested_micro_batch: int | None = None,
    device: str = "cpu",
    job: str = "bench",
) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory; never ask a hub
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from polo.config import load_config
    from polo.models.loading import ensure_builtin_model

    config = load_config(job_config(job, steps, out_dir / "unused", device=device))
    model_dir = str(ensure_builtin_model(config.model.name))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task, rows, prompts = step_prompts(config, tokenizer, steps)
    polo_prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]  # what polo's sampler feeds the model
    # Plain-text prompts (already chat-templated by polo): TRL only tokenizes them, like polo.
    dataset = Dataset.from_dict({"prompt": prompts, "row_index": list(range(len(rows)))})
    reward_funcs, reward_weights = trl_rewards(config, task, rows)
    micro_batch = trl_micro_batch(config, requested_micro_batch)  # by default the same as polo's
    args = trl_arguments(config, variant, micro_batch, out_dir / "run", device, job, reward_weights)
    timer = step_timer(device)
    peft_config = None
    if variant == "trl_lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward_funcs,
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
    final_model = ""
    if job == "demo":  # kept for `polo eval`, which scores it on the held-out problems
        final_model = str(out_dir / "final")
        trainer.save_model(final_model)
        tokenizer.save_pretrained(final_model)
    times = [timer.ends[0] - timer.first_begin] + [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    bf16, checkpointing = TRL_SETTINGS[variant]
    return {
        "precision": "bf16" if bf16 else "fp32",
        "gradient_checkpointing": checkpointing,
        "micro_batch": micro_batch,
        "step_times": times,
        "time_source": "TrainerCallback on_step_end differences",
        "same_prompt_tokens": same_prompt_tokens,
        "completion_length": timer.lengths,
        "peak_rss_train": timer.rss[-1] if timer.rss else None,
        "peak_gpu_train": timer.gpu[-1] if timer.gpu else None,
        "final_model": final_model,
    }


def child_main(args) -> None:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    foreign = ForeignLoad()
    if args.child.startswith("polo"):
        result = run_polo(args.steps, out_dir, lora=args.child == "polo_lora", device=args.device, job=args.job)
    else:
        result = run_trl(args.child, args.steps, out_dir, args.trl_micro_batch, device=args.device, job=args.job)
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


def run_child(
    name: str, steps: int, out_dir: Path, trl_micro_batch: int | None = None, device: str = "cpu", job: str = "bench"
) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)  # a retry starts afresh: no earlier attempt's run or result
    out_dir.mkdir(parents=True)
    log_path = out_dir / "child.log"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        "--steps",
        str(steps),
        "--out",
        str(out_dir),
    ]
    if trl_micro_batch:
        command += ["--trl-micro-batch", str(trl_micro_batch)]
    if device != "cpu" or job != "bench":
        command += ["--device", device, "--job", job]
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
        print(
            f"{name} phase medians (timed steps): "
            + ", ".join(
                f"{key} {median([v for r in runs for v in r['phase_times'][key][1:] if v is not None]):.2f} s"
                for key in phases
            )
        )


# ----------------------------------------------------------------------------------------------
# --device cuda


def gib(num_bytes: float | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**30:.2f} GiB"


def heldout_accuracy(model: str, out_path: Path) -> float:
    """Return `polo eval`'s greedy held-out accuracy of `model` on the demo recipe's task (on the GPU)."""
    command = [
        sys.executable,
        "-m",
        "polo",
        "eval",
        "--recipe",
        str(DEMO_RECIPE),
        "--model",
        model,
        "--greedy",
        "--device",
        "cuda",
        "--no-progress",
        "-o",
        str(out_path),
    ]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        raise SystemExit(f"polo eval of {model} failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
    return float(json.loads(out_path.read_text())["summary"]["pass@1"])


def gpu_step_runs(args, order: list[str], root: Path) -> dict[str, dict]:
    """Return, per run, the median timed step and peak GPU memory over --rounds runs of the benchmark's job."""
    results: dict[str, list[dict]] = {name: [] for name in order}
    for round_index in range(args.rounds):
        for name in order:
            print(f"round {round_index + 1}/{args.rounds}: {name} ...", flush=True)
            result = run_child(
                name, args.steps, root / f"round{round_index + 1}-{name}", args.trl_micro_batch, device="cuda"
            )
            results[name].append(result)
            print(
                f"  {name}: steps {', '.join(f'{t:.2f}' for t in result['step_times'])} s (first is warm-up), "
                f"median {median(result['step_times'][1:]):.2f} s, peak GPU memory {gib(result['peak_gpu_train'])}, "
                f"precision {result['precision']}",
                flush=True,
            )
    return {
        name: {
            "median": median([t for result in runs for t in result["step_times"][1:]]),
            "peak_gpu": max(result["peak_gpu_train"] or 0 for result in runs),
            "precision": runs[0]["precision"],
        }
        for name, runs in results.items()
    }


def gpu_accuracy_runs(args, order: list[str], root: Path) -> None:
    """Train the demo recipe --accuracy-steps steps with each run on the GPU and print its time, memory and held-out
    gain."""
    steps = args.accuracy_steps
    print(
        f"\ndemo recipe ({DEMO_RECIPE.name}), {steps} steps on the GPU; held-out greedy accuracy by polo eval",
        flush=True,
    )
    before = heldout_accuracy(MODEL, root / "demo-eval-base.json")
    print(f"  base model {MODEL}: held-out accuracy {before:.3f}", flush=True)
    for name in order:
        result = run_child(name, steps, root / f"demo-{name}", device="cuda", job="demo")
        after = heldout_accuracy(result["final_model"], root / f"demo-eval-{name}.json")
        times = result["step_times"]
        print(
            f"  {name}: median step {median(times[1:]):.2f} s after a warm-up, "
            f"{sum(times):.1f} s of training for {len(times)} steps, "
            f"peak GPU memory {gib(result['peak_gpu_train'])}; held-out accuracy {before:.3f} -> {after:.3f} "
            f"(gain {after - before:+.3f})",
            flush=True,
        )


def gpu_main(args) -> None:
    """polo against TRL on one GPU: step time and peak GPU memory (and, with --accuracy-steps, the demo's held-out
    gain)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="polo-vs-trl-gpu-"))
    order = [name for name in GPU_RUNS if name in (args.only or GPU_RUNS)]
    print(
        f"polo vs TRL GRPO step on {MODEL} on {torch.cuda.get_device_name()}: {PROMPTS_PER_STEP} prompts x "
        f"{GROUP_SIZE} completions, <= {MAX_NEW_TOKENS} new tokens, T={TEMPERATURE}, beta={BETA}, mu=1, "
        "rewards correct + r1_format"
    )
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); {args.rounds} round(s) of {order}, "
        f"{args.steps} steps per run (first dropped); output in {root}",
        flush=True,
    )
    if "trl_gpu" in order:
        try:
            import trl

            print(f"trl {trl.__version__}: {DESCRIPTIONS['trl_gpu']}", flush=True)
        except ImportError as error:
            raise SystemExit(
                'TRL is not installed: pip install -e ".[bench]" (on the GPU machine: its wheel kit, docs/gpu.md)'
            ) from error
    summary = gpu_step_runs(args, order, root)
    print()
    for name in order:
        print(
            f"{name:<8} {DESCRIPTIONS[name] if name != 'polo' else 'polo defaults, train.device=cuda'} "
            f"({summary[name]['precision']}): median step {summary[name]['median']:.3f} s, "
            f"peak GPU memory {gib(summary[name]['peak_gpu'])}"
        )
    if args.accuracy_steps:
        gpu_accuracy_runs(args, order, root)
    step_ratio = memory_ratio = float("nan")
    if len(summary) == 2:
        step_ratio = summary["trl_gpu"]["median"] / summary["polo"]["median"]
        memory_ratio = summary["polo"]["peak_gpu"] / summary["trl_gpu"]["peak_gpu"]
    print(f"polo_vs_trl_gpu step_time_ratio={fmt(step_ratio)} gpu_memory_ratio={fmt(memory_ratio)}")
    figures = {f"{name} step (s)": summary[name]["median"] for name in order}
    figures.update({f"{name} peak GPU memory (GiB)": summary[name]["peak_gpu"] / 2**30 for name in order})
    ratios = {"step_time_ratio": step_ratio, "gpu_memory_ratio": memory_ratio}
    record_result("grpo_vs_trl", {**figures, **ratios}, args.argv, device="cuda")


def build_parser() -> argparse.ArgumentParser:
    """Return the command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is a warm-up (default 4)")
    parser.add_argument("--rounds", type=int, default=1, help="times to repeat the alternating runs (default 1)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=RUNS + EXTRA_RUNS + GPU_RUNS[1:],
        default=None,
        help="run only these (trl_default, TRL's own bf16 + gradient checkpointing defaults, runs only when named; "
        f"with --device cuda the runs are {', '.join(GPU_RUNS)})",
    )
    parser.add_argument("--out", default=None, help="where runs write (default: a new temporary directory)")
    parser.add_argument(
        "--max-wait",
        type=float,
        default=900.0,
        help="seconds to wait for other processes to go quiet before each measurement (default 900)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="times to redo a run during which other processes used the CPU (default 2)",
    )
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="TRL's per_device_train_batch_size (default: polo's train.micro_batch_size); "
        "gradient accumulation makes up the 32 sequences of a step",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default): the CPU comparison above; cuda: polo (train.device=cuda) against TRL bf16 on one GPU",
    )
    parser.add_argument(
        "--accuracy-steps",
        type=int,
        default=0,
        metavar="N",
        help="with --device cuda: also train the demo recipe N steps (e.g. 40) with both and score each "
        "greedily on its held-out problems (polo eval)",
    )
    parser.add_argument("--child", choices=RUNS + EXTRA_RUNS + GPU_RUNS[1:], help=argparse.SUPPRESS)
    parser.add_argument("--job", choices=("bench", "demo"), default="bench", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command a result is recorded with
    if args.child:
        child_main(args)
        return
    if args.steps < 2:
        parser.error("--steps must be at least 2 (one warm-up step is dropped)")
    if args.device == "cuda":
        gpu_main(args)
        return
    if args.accuracy_steps:
        parser.error("--accuracy-steps goes with --device cuda")
    cpu_main(args)


def cpu_main(args) -> None:
    """polo against TRL on the CPU: step time, peak RSS and the compute floor, run by run."""
    import torch

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="polo-vs-trl-"))
    order = [name for name in RUNS + EXTRA_RUNS if name in (args.only or RUNS)]
    print(
        f"polo vs TRL GRPO step on {MODEL}: {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} completions, "
        f"<= {MAX_NEW_TOKENS} new tokens, T={TEMPERATURE}, beta={BETA}, mu=1, rewards correct + r1_format"
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} round(s) of {order}, "
        f"{args.steps} steps per run (first dropped); output in {root}",
        flush=True,
    )
    try:
        import trl

        print(f"trl {trl.__version__}", flush=True)
    except ImportError as error:
        if any(name.startswith("trl") for name in order):
            raise SystemExit('TRL is not installed: pip install -e ".[bench]"') from error

    # Measure the machine first, while nothing else runs.
    rates, copying = matmul_rates(args.max_wait), copy_rate()
    print(
        f"matmul 2048^3 best rate: bf16 {rates[0] / 1e9:,.1f} GFLOP/s, fp32 {rates[1] / 1e9:,.1f} GFLOP/s, "
        f"fp32 through oneDNN packed {rates[2] / 1e9:,.1f} GFLOP/s; 400 MiB copy {copying / 1e9:,.1f} GB/s",
        flush=True,
    )
    results = measure_rounds(args, order, root)
    after, copying_after = matmul_rates(args.max_wait), copy_rate()
    print(
        f"matmul 2048^3 best rate after the runs: bf16 {after[0] / 1e9:,.1f} GFLOP/s ({after[0] / rates[0] - 1:+.1%}), "
        f"fp32 {after[1] / 1e9:,.1f} GFLOP/s ({after[1] / rates[1] - 1:+.1%}), "
        f"fp32 through oneDNN packed {after[2] / 1e9:,.1f} GFLOP/s ({after[2] / rates[2] - 1:+.1%}); "
        f"400 MiB copy {copying_after / 1e9:,.1f} GB/s ({copying_after / copying - 1:+.1%})",
        flush=True,
    )
    rates = tuple(max(pair) for pair in zip(rates, after, strict=True))  # the floor at the best the machine showed
    summary = print_run_table(args, order, results)
    step_ratio, rss_ratio, floor_fraction = print_polo_against_trl(order, results, summary, rates)
    print_lora_runs(results, summary)
    busy = [
        f"{name} round {i + 1} ({r['foreign_cores']:.2f} cores)"
        for name in order
        for i, r in enumerate(results[name])
        if r["foreign_cores"] > 0.2
    ]
    if busy:
        print("WARNING: other processes used the CPU during " + ", ".join(busy) + "; those timings are inflated")
    print(
        f"polo_vs_trl step_time_ratio={fmt(step_ratio)} peak_rss_ratio={fmt(rss_ratio)} "
        f"floor_fraction={fmt(floor_fraction)}"
    )
    figures = {f"{name} step (s)": summary[name]["median"] for name in order}
    figures.update({f"{name} peak RSS (GiB)": summary[name]["peak_train"] / 2**30 for name in order})
    ratios = {"step_time_ratio": step_ratio, "peak_rss_ratio": rss_ratio, "floor_fraction": floor_fraction}
    record_result("grpo_vs_trl", {**figures, **ratios, "others_busy": bool(busy)}, args.argv)


def measure_rounds(args, order: list[str], root: Path) -> dict[str, list[dict]]:
    """Return each run's results, one per round; a run during which other processes used the CPU is redone."""
    results: dict[str, list[dict]] = {name: [] for name in order}
    for round_index in range(args.rounds):
        for name in order:
            for attempt in range(args.retries + 1):
                wait_for_quiet(args.max_wait)
                print(f"round {round_index + 1}/{args.rounds}: {name} ...", flush=True)
                result = run_child(name, args.steps, root / f"round{round_index + 1}-{name}", args.trl_micro_batch)
                if result["foreign_cores"] < 0.2 or attempt == args.retries:
                    break
                print(
                    f"  other processes used {result['foreign_cores']:.2f} CPU cores during that run "
                    f"(steps {', '.join(f'{t:.1f}' for t in result['step_times'])} s); running it again",
                    flush=True,
                )
            results[name].append(result)
            timed = result["step_times"][1:]
            print(
                f"  {name}: steps {', '.join(f'{t:.2f}' for t in result['step_times'])} s "
                f"(first is warm-up), median {median(timed):.2f} s, peak RSS {mib(result['peak_rss'])}, "
                f"process {result['process_wall']:.0f} s, other processes {result['foreign_cores']:.2f} cores",
                flush=True,
            )
    return results


def print_run_table(args, order: list[str], results: dict[str, list[dict]]) -> dict[str, dict]:
    """Return each run's median step and peak RSS over its rounds, after printing a row per round and a summary."""
    print()
    header = (
        f"{'run':<11} {'setting':<31} {'round':>5} {'median step':>11} {'timed steps (s)':<22} {'mean len':>8} "
        f"{'peak RSS train':>14} {'peak RSS proc':>13} {'others':>6}"
    )
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
            mean_length = fmt(sum(lengths) / len(lengths) if lengths else float("nan"), ".1f")
            print(
                f"{name:<11} {DESCRIPTIONS[name]:<31} {round_index + 1:>5} {median(timed):>10.2f}s "
                f"{', '.join(f'{t:.1f}' for t in timed):<22} {mean_length:>8} "
                f"{mib(train_peak):>14} {mib(result['peak_rss']):>13} {result['foreign_cores']:>6.2f}"
            )
        summary[name] = {"median": median(all_timed), "peak_train": max(peaks_train), "peak": max(peaks)}
    print()
    for name in order:
        s = summary[name]
        print(
            f"{name:<11} ({results[name][0].get('precision', '?')}) median step {s['median']:.2f} s over "
            f"{args.rounds} round(s); peak RSS {mib(s['peak_train'])} at the last step, {mib(s['peak'])} whole process"
        )
    return summary


def print_polo_against_trl(
    order: list[str], results: dict[str, list[dict]], summary: dict[str, dict], rates: tuple[float, float]
) -> tuple[float, float, float]:
    """Return (TRL's fastest step / polo's, polo's peak RSS / TRL's leanest, the compute floor / polo's step), printed.

    NaN where polo or TRL did not run.
    """
    step_ratio = rss_ratio = floor_fraction = float("nan")
    if "polo" not in summary:
        return step_ratio, rss_ratio, floor_fraction
    rate_bf16, rate_fp32, rate_packed = rates
    polo_median = summary["polo"]["median"]
    # The floor is the least work at the best rate this machine offers: every group's prompt counted once (and the
    # opening all of a step's prompts share, once),
    # and the fastest of the measured kernels: bf16, fp32 and oneDNN's packed fp32 (a floor_fraction above 1
    # would be a bug in the floor).
    tokens = median([t for result in results["polo"] for t in result["floor_tokens"][1:]])
    n_params = parameter_count(MODEL)
    flops = (6 + 2 + 2) * n_params * tokens
    best_rate, best_dtype = max((rate_bf16, "bf16"), (rate_fp32, "fp32"), (rate_packed, "fp32 oneDNN-packed"))
    floor = flops / best_rate
    floor_fraction = floor / polo_median
    print(
        f"compute floor: N = {n_params:,} parameters, T = {tokens:,.0f} tokens per step (each group's prompt once, "
        f"their common opening once, the completions; median of polo's timed steps), "
        f"10*N*T = {flops / 1e12:.2f} TFLOP at the faster measured "
        f"rate (the higher of the two probes), {best_dtype} {best_rate / 1e9:,.1f} GFLOP/s "
        f"(bf16 {rate_bf16 / 1e9:,.1f}, fp32 {rate_fp32 / 1e9:,.1f}, "
        f"fp32 oneDNN-packed {rate_packed / 1e9:,.1f}) "
        f"= {floor:.2f} s = {floor_fraction:.1%} of polo's median step"
    )
    first = results["polo"][0]
    print(
        f"polo settings: precision {first['precision']}, gradient checkpointing {first['gradient_checkpointing']}, "
        f"micro-batch {first['micro_batch']}; step time from {first['time_source']}"
    )
    print_phase_medians("polo", results["polo"])
    trl_runs = [name for name in order if name in FULL_RUNS and name.startswith("trl")]
    if trl_runs:
        fastest = min(trl_runs, key=lambda name: summary[name]["median"])
        leanest = min(trl_runs, key=lambda name: summary[name]["peak_train"])
        step_ratio = summary[fastest]["median"] / polo_median
        rss_ratio = summary["polo"]["peak_train"] / summary[leanest]["peak_train"]
        same = all(r.get("same_prompt_tokens") for name in trl_runs for r in results[name])
        trl_micro_batch = results[trl_runs[0]][0]["micro_batch"]
        print(
            f"TRL prompt tokens identical to polo's: {same}; TRL micro-batch {trl_micro_batch} x "
            f"{PROMPTS_PER_STEP * GROUP_SIZE // trl_micro_batch} accumulation steps"
        )
        print(
            f"TRL fastest: {fastest} ({summary[fastest]['median']:.2f} s); TRL lowest peak: {leanest} "
            f"({mib(summary[leanest]['peak_train'])}); peak RSS compared at the end of the last step"
        )
    return step_ratio, rss_ratio, floor_fraction


def print_lora_runs(results: dict[str, list[dict]], summary: dict[str, dict]) -> None:
    """Print the LoRA runs beside the comparison (not in its ratios), when they ran."""
    lora_runs = [name for name in LORA_RUNS if name in summary]
    if not lora_runs:
        return
    both = ""
    if len(lora_runs) == 2:
        polo_lora, trl_lora = summary["polo_lora"], summary["trl_lora"]
        both = (
            f"; trl_lora / polo_lora step time {trl_lora['median'] / polo_lora['median']:.3f}, "
            f"peak RSS {polo_lora['peak_train'] / trl_lora['peak_train']:.3f}"
        )
    print(
        "LoRA beside (r=16 on every linear layer; not in the ratios below): "
        + "; ".join(f"{name} {summary[name]['median']:.2f} s, {mib(summary[name]['peak_train'])}" for name in lora_runs)
        + both
    )
    if "polo_lora" in results:
        print_phase_medians("polo_lora", results["polo_lora"])


if __name__ == "__main__":
    main()
