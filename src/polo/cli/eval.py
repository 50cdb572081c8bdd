"""`polo eval`: a thin wrapper over `polo.evaluate` (pass@1, pass@k, cons@k of a model on a recipe's task).

The task comes from a `polo train` recipe (`--recipe`, or dotted overrides such as `task.name=hf
task.path=...`), so every task kind evaluates as it trains; `--task arith | gsm8k | jsonl:FILE` are
shorthands for the common ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from polo.cli.commands import COMMANDS
from polo.config.schema import DEFAULT_MODEL, DEVICE_HELP

TASK_SHORTHANDS = "arith | gsm8k | jsonl:FILE"
# A file named by a shorthand is all held-out problems: no training rows, every row evaluated.
HELD_OUT_FILE = {"task.num_train": 0, "task.num_eval": None}


@COMMANDS.register("eval")
def add_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `eval` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser(
        "eval",
        help="pass@1, pass@k, cons@k, format rate and length of a model on a task",
        description=(
            "Sample K completions per held-out problem of a recipe's task and report pass@1 (mean correctness), "
            "pass@k (unbiased estimator), cons@k (majority vote), the format compliance rate (tasks that ask for "
            "<answer> tags) and the mean response length; per-problem results go to eval.json."
        ),
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted.key=value overrides of the recipe, e.g. task.name=hf task.path=DIR"
    )
    parser.add_argument(
        "--recipe",
        default=None,
        help="a polo train recipe YAML or a run directory (its config.yaml): its model, task and prompt",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face causal-LM directory, a built-in name or a Hub id org/name[@revision] "
        f"(default: the recipe's model, else {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--task",
        default=None,
        help=f"{TASK_SHORTHANDS}, or any task.name (default: the recipe's task, else arithmetic)",
    )
    parser.add_argument(
        "--samples", "-k", type=int, default=None, help="completions per problem, K (default 16; 1 with --greedy)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.6, help="sampling temperature (default 0.6, DeepSeek-R1's setting)"
    )
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    parser.add_argument("--greedy", action="store_true", help="one deterministic (greedy) answer per problem")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N held-out problems only")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="completion budget (default: the recipe's eval.max_new_tokens, else its sampling.max_new_tokens)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="sequences generated together (default 64)")
    add_task_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `polo eval`'s task-format, reward-model, device and output options to its parser."""
    parser.add_argument(
        "--data-dir", default=None, help="--task gsm8k: the folder holding test.jsonl (default: $POLO_GSM8K_DIR)"
    )
    parser.add_argument(
        "--answer-in-tags", action="store_true", help="R1 form: ask for <think>/<answer> tags; only <answer> counts"
    )
    parser.add_argument("--checker", default=None, help="jsonl and hf tasks: the task.checker")
    parser.add_argument(
        "--prompt-field",
        default=None,
        help="jsonl and hf tasks: the field holding the problem (default: question, else TRL's prompt)",
    )
    parser.add_argument(
        "--answer-field",
        default=None,
        help="jsonl and hf tasks: the field holding the answer (default: answer, else TRL's solution)",
    )
    parser.add_argument("--instruction", default=None, help="prompt template with {question} (default: the task's)")
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument(
        "--reward-model",
        default=None,
        metavar="PATH[?normalize]",
        help="also score every sample with this reward model (polo rm); reports its mean over all, correct and "
        "wrong samples",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument(
        "--precision", default=None, choices=("auto", "fp32", "bf16"), help="default: the recipe's (auto)"
    )
    parser.add_argument("--device", default=None, help=f"{DEVICE_HELP} (default: the recipe's, auto)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--output", "-o", default="eval.json", help="where to write the per-problem results (default eval.json)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Evaluate through `polo.evaluate`, print the summary and where the per-problem results are."""
    import polo
    from polo.evaluation.evaluate import EvalSettings

    settings = EvalSettings(
        samples=args.samples,
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        reward_model=args.reward_model,
        progress=not args.no_progress,
    )
    result = polo.evaluate(eval_recipe(args), args.overrides, settings=settings, output=args.output)
    print(format_summary(result.summary, result.settings["max_new_tokens"], result.settings["answer_in_tags"]))
    print(f"per-problem results: {result.output}")
    return 0


def eval_recipe(args: argparse.Namespace) -> dict:
    """Return the recipe to evaluate: `--recipe`'s (a run directory's config.yaml), with the flags set over it."""
    from polo.config import read_recipe

    recipe = None if args.recipe is None else Path(args.recipe)
    data = read_recipe(recipe / "config.yaml" if recipe is not None and recipe.is_dir() else recipe)
    flags = {
        "model.name": args.model,
        "task.instruction": args.instruction,
        "task.system_prompt": args.system_prompt,
        "task.answer_in_tags": True if args.answer_in_tags else None,
        "task.checker": args.checker,
        "task.prompt_field": args.prompt_field,
        "task.answer_field": args.answer_field,
        "train.precision": args.precision,
        "train.device": args.device,
        "train.threads": args.threads,
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    flags.update(task_shorthand(args.task, args.data_dir) if args.task is not None else {})
    for key, value in flags.items():
        section, _, name = key.partition(".")
        data[section] = {**(data.get(section) or {}), name: value}
    return data


def task_shorthand(task: str, data_dir: str | None) -> dict:
    """Return the recipe keys `--task` sets: arith, gsm8k (its test.jsonl only) and jsonl:FILE (every row of the
    file held out), or any task.name."""
    if task in ("arith", "arithmetic"):
        return {"task.name": "arithmetic"}
    if task == "gsm8k":
        from polo.data.gsm8k import gsm8k_data_dir

        test_path = str(gsm8k_data_dir(data_dir) / "test.jsonl")
        # Evaluation reads only the held-out file: it stands in for the (unused) train file too.
        return {"task.name": "gsm8k", "task.train_path": test_path, "task.eval_path": test_path, **HELD_OUT_FILE}
    if task.startswith("jsonl:") and len(task) > len("jsonl:"):
        path = task[len("jsonl:") :]
        return {"task.name": "jsonl", "task.train_path": path, "task.eval_path": path, **HELD_OUT_FILE}
    return {"task.name": task}


def format_summary(summary: dict, max_new_tokens: int, answer_in_tags: bool) -> str:
    """Return the summary as a plain aligned table: one row per k, then the sample-level rates (the R1 format's
    compliance only when the task asks for that format)."""
    num_samples = summary["samples_per_problem"]
    lines = [f"{'k':>4}  {'pass@k':>7}  {'cons@k':>7}"]
    for k, value in summary["pass@k"].items():
        lines.append(f"{k:>4}  {value:>7.3f}  {summary['cons@k'][k]:>7.3f}")
    facts = [
        (f"pass@1 (mean over {num_samples} sample{'s' if num_samples > 1 else ''})", f"{summary['pass@1']:.3f}"),
        *([("format compliance (r1_format)", f"{summary['format_compliance']:.3f}")] if answer_in_tags else []),
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
