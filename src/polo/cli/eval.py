"""The `polo eval` and `polo report` subcommands: thin wrappers over polo.evaluation.evaluate and .report.

`polo.cli` calls `add_parsers(subcommands)` to register both, and `run(args)` to execute one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from polo.models.loading import DEFAULT_MODEL

GSM8K_ENV = "POLO_GSM8K_DIR"
TASK_NAMES = ("arith", "arithmetic", "gsm8k", "jsonl:FILE")
DEFAULT_MAX_NEW_TOKENS = {"arithmetic": 32, "gsm8k": 256, "jsonl": 256}


class EvalArgumentError(ValueError):
    """Command-line arguments that do not make a valid evaluation."""


def add_parsers(subcommands) -> None:
    """Add the `eval` and `report` subcommands to an argparse subparsers object."""
    add_eval_parser(subcommands)
    add_report_parser(subcommands)


def add_eval_parser(subcommands) -> None:
    """Add the `eval` subcommand to an argparse subparsers object."""
    eval_parser = subcommands.add_parser(
        "eval",
        help="pass@1, pass@k, cons@k, format rate and length of a model on a task",
        description=(
            "Sample K completions per held-out problem and report pass@1 (mean correctness), "
            "pass@k (unbiased estimator), cons@k (majority vote), the r1_format compliance rate "
            "and the mean response length; per-problem results go to eval.json."
        ),
    )
    eval_parser.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face causal-LM directory, a built-in name or a Hub id org/name[@revision] "
        f"(default: {DEFAULT_MODEL}, or the recipe's model)",
    )
    eval_parser.add_argument(
        "--task", default=None, help="arith | gsm8k | jsonl:FILE (default: arith, or the recipe's task)"
    )
    eval_parser.add_argument(
        "--recipe",
        default=None,
        help="take the task, prompt and model from a recipe YAML or a run directory (its config.yaml)",
    )
    eval_parser.add_argument(
        "--samples", "-k", type=int, default=None, help="completions per problem, K (default 16; 1 with --greedy)"
    )
    eval_parser.add_argument(
        "--temperature",
        type=float,
        default=0.6,
        help="sampling temperature (default 0.6, DeepSeek-R1's evaluation setting)",
    )
    add_sampling_arguments(eval_parser)


def add_sampling_arguments(eval_parser) -> None:
    """Add `polo eval`'s sampling, task-format, device and output options to its parser."""
    eval_parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    eval_parser.add_argument("--greedy", action="store_true", help="one deterministic (greedy) answer per problem")
    eval_parser.add_argument("--limit", type=int, default=None, help="evaluate the first N held-out problems only")
    eval_parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="completion budget (default: 32 arith, 256 gsm8k/jsonl, or the recipe's eval setting)",
    )
    eval_parser.add_argument("--batch-size", type=int, default=64, help="sequences generated together (default 64)")
    eval_parser.add_argument(
        "--data-dir",
        default=None,
        help=f"GSM8K folder holding test.jsonl (default: ${GSM8K_ENV}, else ../shared/data/gsm8k)",
    )
    eval_parser.add_argument(
        "--answer-in-tags",
        action="store_true",
        help="R1 form: ask for <think>/<answer> tags; only an <answer> block counts",
    )
    eval_parser.add_argument(
        "--checker", default="math_verify", help="jsonl tasks: math_verify | exact_number | exact_string"
    )
    eval_parser.add_argument(
        "--prompt-field",
        default=None,
        help="jsonl tasks: the field holding the problem (default: question, else prompt)",
    )
    eval_parser.add_argument(
        "--answer-field",
        default=None,
        help="jsonl tasks: the field holding the reference answer (default: answer, else solution)",
    )
    eval_parser.add_argument(
        "--instruction", default=None, help="prompt template with {question} (default: the task's)"
    )
    eval_parser.add_argument("--system-prompt", default=None)
    eval_parser.add_argument(
        "--reward-model",
        default=None,
        metavar="PATH[?normalize]",
        help="also score every sample with this reward model (polo rm); reports its mean over all, correct and "
        "wrong samples",
    )
    eval_parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    eval_parser.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "bf16"),
        help="auto: bf16 autocast where the CPU supports it",
    )
    eval_parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: CUDA when available)")
    eval_parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    eval_parser.add_argument(
        "--output", "-o", default="eval.json", help="where to write the per-problem results (default eval.json)"
    )
    eval_parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    eval_parser.set_defaults(eval_cli_command="eval")


def add_report_parser(subcommands) -> None:
    """Add the `report` subcommand to an argparse subparsers object."""
    report_parser = subcommands.add_parser(
        "report",
        help="one self-contained HTML page of a run: config, curves, sample completions",
        description="Write RUN_DIR/report.html (images embedded) from a run's config.yaml, metrics.jsonl, "
        "eval_step*.json and samples.jsonl.",
    )
    report_parser.add_argument("run_dir")
    report_parser.add_argument("--output", "-o", default=None, help="HTML path (default RUN_DIR/report.html)")
    report_parser.add_argument(
        "--sample-steps", type=int, default=4, help="how many steps to show best/worst completions for (default 4)"
    )
    report_parser.set_defaults(eval_cli_command="report")


def run(args: argparse.Namespace) -> int:
    """Run the `eval` or `report` subcommand the arguments were parsed for; return the exit status."""
    try:
        if args.eval_cli_command == "eval":
            return run_eval(args)
        return run_report(args)
    except EvalArgumentError as error:
        print(f"polo: error: {error}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------- polo report


def run_report(args: argparse.Namespace) -> int:
    from polo.evaluation.report import write_report

    path = write_report(args.run_dir, args.output, sample_steps=args.sample_steps)
    print(path)
    return 0


# ---------------------------------------------------------------- polo eval


def gsm8k_data_dir(explicit: str | None = None) -> Path:
    """Return the GSM8K folder: `explicit`, else $POLO_GSM8K_DIR, else ../shared/data/gsm8k.

    The relative default is looked for beside the current directory and beside the polo
    source checkout, so it works from the repository root and from elsewhere in a checkout.
    """
    if explicit is not None:
        candidates = [Path(explicit).expanduser()]
    elif os.environ.get(GSM8K_ENV):
        candidates = [Path(os.environ[GSM8K_ENV]).expanduser()]
    else:
        repo_root = Path(__file__).resolve().parents[3]
        candidates = [Path.cwd().parent / "shared" / "data" / "gsm8k", repo_root.parent / "shared" / "data" / "gsm8k"]
    for candidate in candidates:
        if (candidate / "test.jsonl").is_file():
            return candidate
    tried = ", ".join(str(candidate / "test.jsonl") for candidate in dict.fromkeys(candidates))
    raise FileNotFoundError(f"GSM8K test file not found (looked for {tried}); pass --data-dir DIR or set {GSM8K_ENV}")


def parse_task_name(task: str) -> tuple[str, str | None]:
    """Return `(task name, jsonl file or None)` for "arith", "gsm8k" or "jsonl:FILE"."""
    if task in ("arith", "arithmetic"):
        return "arithmetic", None
    if task == "gsm8k":
        return "gsm8k", None
    if task.startswith("jsonl:") and len(task) > len("jsonl:"):
        return "jsonl", task[len("jsonl:") :]
    raise EvalArgumentError(f"--task {task!r} is not one of {', '.join(TASK_NAMES)}")


def build_eval_task(args: argparse.Namespace):
    """Return `(task, task_label, instruction, system_prompt, model_name, default_max_new_tokens)`."""
    from polo.data import arithmetic_task, gsm8k_task, jsonl_task

    if args.recipe is not None:
        from polo.config import load_config
        from polo.data import instruction_for, make_task

        if args.task is not None or args.answer_in_tags:
            raise EvalArgumentError("--recipe names its task and answer form; drop --task/--answer-in-tags")
        recipe = Path(args.recipe)
        if recipe.is_dir():
            recipe = recipe / "config.yaml"
        config = load_config(str(recipe))
        task = make_task(config)
        instruction = args.instruction if args.instruction is not None else instruction_for(config)
        system_prompt = args.system_prompt if args.system_prompt is not None else config.task.system_prompt
        tokens = config.eval.max_new_tokens or config.sampling.max_new_tokens
        return task, f"{task.name} ({recipe})", instruction, system_prompt, args.model or config.model.name, tokens

    name, path = parse_task_name(args.task or "arith")
    tags = args.answer_in_tags
    if name == "arithmetic":
        # The defaults of recipes/grpo_arith.yaml, so the held-out set is the one training reports on.
        task, label = arithmetic_task(answer_in_tags=tags), "arithmetic"
    elif name == "gsm8k":
        test_path = gsm8k_data_dir(args.data_dir) / "test.jsonl"
        # Evaluation reads only the held-out file: it stands in for the (unused) train file too.
        task, label = gsm8k_task(test_path, test_path, num_train=0, answer_in_tags=tags), f"gsm8k ({test_path})"
    else:
        from polo.rewards.answers import CHECKERS

        if args.checker not in CHECKERS:
            raise EvalArgumentError(f"--checker {args.checker!r} is not one of {', '.join(CHECKERS)}")
        task = jsonl_task(
            path,
            path,
            prompt_field=args.prompt_field,
            answer_field=args.answer_field,
            num_train=0,
            answer_in_tags=tags,
            checker=args.checker,
        )
        label = f"jsonl ({path}, {args.checker})"
    return task, label, args.instruction, args.system_prompt, args.model or DEFAULT_MODEL, DEFAULT_MAX_NEW_TOKENS[name]


def check_numbers(args: argparse.Namespace) -> int:
    """Return the number of samples per problem, after checking the numeric arguments."""
    if args.greedy:
        if args.samples not in (None, 1):
            raise EvalArgumentError(f"--greedy gives one answer per problem; drop --samples {args.samples}")
        samples = 1
    else:
        samples = 16 if args.samples is None else args.samples
    if samples < 1:
        raise EvalArgumentError(f"--samples must be >= 1, got {samples}")
    if not 0 <= args.temperature < float("inf"):  # NaN fails this too
        raise EvalArgumentError(f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise EvalArgumentError(f"--top-p must be in (0, 1], got {args.top_p}")
    for flag, value in (
        ("--limit", args.limit),
        ("--max-new-tokens", args.max_new_tokens),
        ("--batch-size", args.batch_size),
        ("--threads", args.threads),
    ):
        if value is not None and value < 1:
            raise EvalArgumentError(f"{flag} must be >= 1, got {value}")
    return samples


def run_eval(args: argparse.Namespace) -> int:
    """Run `polo eval`; return the exit status.

    Writing into a run directory, it holds that run's lock first (`polo.runtime.run_lock`).
    """
    from polo.runtime.run_lock import is_run_dir, owned_run_dir

    run_dir = Path(args.output).parent
    if not is_run_dir(run_dir):  # eval.json in a plain folder: no run to guard
        return evaluate_to_file(args)
    with owned_run_dir(run_dir, "the run directory of --output", "write --output elsewhere"):
        return evaluate_to_file(args)


def held_out_rows(rows: list[dict], limit: int | None, task_label: str) -> list[dict]:
    """Return the first `limit` held-out rows (all of them when None), or raise when there are too few."""
    if limit is not None:
        if limit > len(rows):
            raise EvalArgumentError(f"--limit {limit} is more than the {len(rows)} held-out problems of {task_label}")
        rows = rows[:limit]
    if not rows:
        raise EvalArgumentError(f"{task_label} has no held-out problems to evaluate")
    return rows


def evaluate_to_file(args: argparse.Namespace) -> int:
    """Evaluate the model the arguments name, print the summary and write `--output`; return the exit status."""
    import torch

    from polo.evaluation.evaluate import evaluate_policy
    from polo.generation.grouped import GroupSampling, load_for_sampling
    from polo.runtime.device import inference_compute

    samples = check_numbers(args)
    task, task_label, instruction, system_prompt, model_name, default_tokens = build_eval_task(args)
    rows = held_out_rows(task.eval_rows, args.limit, task_label)
    max_new_tokens = args.max_new_tokens or default_tokens
    temperature, top_p = (0.0, 1.0) if args.greedy else (args.temperature, args.top_p)
    compute = inference_compute(args.precision, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    reward_model = None
    if args.reward_model:  # load it first: a wrong path fails before any sampling
        from polo.rewards.reward_model import REWARD_PREFIX, reward_model_reward

        reward_model = reward_model_reward(REWARD_PREFIX + args.reward_model, task)
    model, tokenizer = load_for_sampling(model_name, compute)
    prompts = task.prompts(tokenizer, rows, instruction, system_prompt)
    settings = {
        "model": model_name,
        "task": task_label,
        "num_problems": len(rows),
        "samples": samples,
        "greedy": args.greedy,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "precision": compute.precision,
        "device": str(compute.device),
        "seed": args.seed,
        "batch_size": args.batch_size,
        "reward_model": args.reward_model,
    }
    print(
        f"polo eval: {model_name} on {task_label}: {len(rows)} problems x {samples} "
        f"{'greedy answer' if args.greedy else f'samples (T={temperature}, top_p={top_p})'}, "
        f"max {max_new_tokens} new tokens, {compute}",
        flush=True,
    )
    started = time.perf_counter()
    sampling = GroupSampling(
        samples=samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        batch_size=args.batch_size,
        compute=compute,
        progress=not args.no_progress,
        description="polo eval",
        sampler=recipe_sampler(args, task, compute),
    )
    result = evaluate_policy(model, tokenizer, prompts, rows, task.correctness, sampling)
    if reward_model is not None:
        from polo.evaluation.evaluate import add_reward_scores

        add_reward_scores(result, reward_model)
    wall_time = time.perf_counter() - started
    summary = {**result["summary"], "wall_time_s": wall_time}
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"settings": settings, "summary": summary, "problems": result["problems"]}, indent=1))
    print(format_summary(summary, max_new_tokens))
    print(f"per-problem results: {output}")
    return 0


def recipe_sampler(args: argparse.Namespace, task, compute):
    """Return the sampler a recipe's task runs with (episodes through its environment), None for the default one."""
    if task.environment is None:
        return None
    from polo.config import load_config
    from polo.data.environments import sampler_for

    recipe = Path(args.recipe)
    return sampler_for(load_config(str(recipe / "config.yaml" if recipe.is_dir() else recipe)), task, compute)


def format_summary(summary: dict, max_new_tokens: int) -> str:
    """Return the summary as a plain aligned table: one row per k, then the sample-level rates."""
    num_samples = summary["samples_per_problem"]
    lines = [f"{'k':>4}  {'pass@k':>7}  {'cons@k':>7}"]
    for k, value in summary["pass@k"].items():
        lines.append(f"{k:>4}  {value:>7.3f}  {summary['cons@k'][k]:>7.3f}")
    facts = [
        (f"pass@1 (mean over {num_samples} sample{'s' if num_samples > 1 else ''})", f"{summary['pass@1']:.3f}"),
        ("format compliance (r1_format)", f"{summary['format_compliance']:.3f}"),
        ("samples with an extractable answer", f"{summary['answered']:.3f}"),
        ("mean response length", f"{summary['mean_response_length']:.1f} tokens"),
        (f"truncated at {max_new_tokens} tokens", f"{summary['truncated']:.3f}"),
        *(
            [
                (
                    "reward model score, mean (correct / wrong samples)",
                    f"{summary['reward_model_mean']:.3f} ({summary['reward_model_mean_correct']:.3f} / "
                    f"{summary['reward_model_mean_wrong']:.3f})",
                )
            ]
            if "reward_model_mean" in summary
            else []
        ),
        *(
            [
                ("tool calls per episode", f"{summary['tool_calls_per_episode']:.3f}"),
                ("tool call success rate", f"{summary['tool_call_success_rate']:.3f}"),
                ("model turns per episode", f"{summary['turns_per_episode']:.2f}"),
                ("correct answers that used the tool", f"{summary['correct_that_used_the_tool']:.3f}"),
            ]
            if "tool_calls_per_episode" in summary
            else []
        ),
        ("problems", str(summary["num_problems"])),
        ("wall time", f"{summary['wall_time_s']:.0f} s"),
    ]
    width = max(len(label) for label, _ in facts)
    lines.append("")
    lines.extend(f"{label:<{width}}  {value}" for label, value in facts)
    return "\n".join(lines)
