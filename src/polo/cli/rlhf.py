"""The RLHF subcommands: `polo sft`, `polo rm`, `polo dpo` and `polo make-preferences`.

Thin wrappers over `polo.finetune.sft.sft`, `polo.finetune.reward_model.train_reward_model`, `polo.finetune.dpo.dpo`
and `polo.data.preferences.write_arithmetic_preferences`; each registers itself in `polo.cli.commands.COMMANDS`.
"""

from __future__ import annotations

import argparse
import functools

from polo.cli.commands import COMMANDS, add_recipe_arguments
from polo.cli.config import KeyHelp
from polo.config.schema import DEVICE_HELP

FINETUNE_HELP = {
    "sft": "supervised fine-tuning on prompt/response demonstrations (loss on the responses only)",
    "rm": "train a reward model (causal-LM trunk + scalar head) on comparisons (pairs or K-way rankings)",
    "dpo": "Direct Preference Optimization on comparisons (pairs or K-way rankings)",
}


def mistake_list(text: str) -> list[str]:
    """Return `--mistakes` ("carry,units") as kinds of `polo.data.preferences.wrong_answer`; argparse reports a
    bad one."""
    from polo.data.preferences import MISTAKES

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MISTAKES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(MISTAKES)}, comma-separated")
    return names


def add_finetune_parser(name: str, subcommands) -> argparse.ArgumentParser:
    """Add the `sft`, `rm` or `dpo` subcommand (`name`) to an argparse subparsers object; return its parser."""
    help_text = FINETUNE_HELP[name]
    parser = subcommands.add_parser(name, help=help_text, description=help_text, add_help=False)
    parser.add_argument("-h", "--help", action=KeyHelp, command=name)
    add_recipe_arguments(parser, f"recipes/rlhf_{name}.yaml", "dotted.key=value overrides, e.g. train.max_steps=10")
    parser.add_argument(
        "--device", default=None, help=f"{DEVICE_HELP}; the same as train.device=... (default: the recipe's)"
    )
    parser.set_defaults(run=run_finetune)
    return parser


for _name in FINETUNE_HELP:
    COMMANDS.register(_name)(functools.partial(add_finetune_parser, _name))


@COMMANDS.register("make-preferences")
def add_preferences_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `make-preferences` subcommand to an argparse subparsers object; return its parser."""
    data_parser = subcommands.add_parser(
        "make-preferences",
        help="write arithmetic SFT demonstrations and comparisons as jsonl, or (--from-model) comparisons of a "
        "model's own answers",
        description=(
            "Write sft_train/sft_eval/preferences_train/preferences_eval.jsonl to OUT_DIR: arithmetic problems "
            "from the training split of the RL task (never its held-out problems); demonstrations give the correct "
            "concise answer, comparisons prefer it to the same answer with a mistake (by default in the carry into "
            "the tens)."
        ),
    )
    data_parser.add_argument("out_dir")
    data_parser.add_argument(
        "--recipe",
        default=None,
        help="an RL recipe (polo train) whose arithmetic task settings and instruction to use (default: the "
        "built-in defaults, those of recipes/rlhf_rl.yaml)",
    )
    data_parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="shuffles problems into splits and picks wrong answers and wordings (default 0)",
    )
    data_parser.add_argument("--num-sft", type=int, default=1000, help="SFT demonstrations (default 1000)")
    data_parser.add_argument("--num-sft-eval", type=int, default=100, help="held-out SFT demonstrations (default 100)")
    data_parser.add_argument(
        "--num-comparisons",
        type=int,
        default=3000,
        help="comparisons, the correct answer over a wrong one (default 3000)",
    )
    data_parser.add_argument("--num-comparisons-eval", type=int, default=200, help="held-out comparisons (default 200)")
    data_parser.add_argument(
        "--mistakes",
        type=mistake_list,
        default=["carry"],
        help="kinds of wrong answer in the comparisons, cycled problem by problem, comma-separated: "
        "carry (the carry into the tens forgotten or added), tens (the tens digit off by one the other way), "
        "units (off by one) (default: carry)",
    )
    sampled = data_parser.add_argument_group(
        "comparisons of a model's own answers",
        "with --from-model, write preferences_train/eval.jsonl from the model's samples on the RL task's training "
        "problems instead, each correct sample ranked above a wrong one by the task's checker (any task of the recipe)",
    )
    sampled.add_argument(
        "--from-model",
        default=None,
        metavar="MODEL",
        help="a causal-LM directory, built-in name or Hub id org/name to sample",
    )
    sampled.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8, the RL group size)")
    sampled.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0, as in RL)")
    sampled.add_argument("--num-prompts", type=int, default=1500, help="training prompts to sample (default 1500)")
    sampled.add_argument("--num-prompts-eval", type=int, default=200, help="held-out prompts to sample (default 200)")
    sampled.add_argument("--device", default="auto", help=f"where the model samples: {DEVICE_HELP}")
    sampled.add_argument("--max-pairs", type=int, default=4, help="comparisons per prompt at most (default 4)")
    data_parser.set_defaults(run=make_preferences)
    return data_parser


# What `polo sft | rm | dpo` print after "saved ...": (label, key of the held-out figures) before -> after.
HEADLINES = {
    "sft": (("held-out loss", "loss"),),
    "rm": (("held-out pair accuracy", "pair_accuracy"),),
    "dpo": (
        ("held-out preference accuracy (implicit reward)", "rewards/accuracies"),
        ("held-out reward margin", "rewards/margins"),
    ),
}


def run_finetune(args: argparse.Namespace) -> int:
    """Run `polo sft`, `rm` or `dpo` through `polo.sft`, `polo.rm` or `polo.dpo`; return the exit status."""
    import polo

    overrides = [*args.overrides, f"train.device={args.device}"] if args.device is not None else args.overrides
    result = getattr(polo, args.command)(args.recipe, overrides)
    print(f"saved {result.model_dir} ({result.steps} steps, {result.seconds:.0f} s)")
    for label, key in HEADLINES[args.command]:
        _print_change(label, result, key)
    return 0


def _print_change(label: str, result, key: str) -> None:
    if result.eval_before is not None and result.eval_after is not None:
        print(f"{label}: {result.eval_before[key]:.3f} -> {result.eval_after[key]:.3f}")


def make_preferences(args: argparse.Namespace) -> int:
    """Write the built-in arithmetic data set for the RL task of `--recipe` (or the default task)."""
    from polo.config import ConfigError, load_config
    from polo.data import instruction_for, make_task
    from polo.data.preferences import write_arithmetic_preferences

    config = load_config(args.recipe)
    if args.from_model is not None:
        return sampled_preferences(args, config)
    if config.task.name != "arithmetic":
        raise ConfigError(f"make-preferences builds arithmetic data; the recipe's task.name is {config.task.name!r}")
    if config.task.answer_in_tags:
        raise ConfigError(
            "make-preferences writes plain answers ('47 + 38 = 85'); the recipe sets task.answer_in_tags=true"
        )
    task = make_task(config)  # the RL run's own task: its held-out problems are left out
    paths = write_arithmetic_preferences(
        args.out_dir,
        task,
        instruction=instruction_for(config, task),
        seed=args.seed,
        num_sft=args.num_sft,
        num_sft_eval=args.num_sft_eval,
        num_comparisons=args.num_comparisons,
        num_comparisons_eval=args.num_comparisons_eval,
        mistakes=args.mistakes,
    )
    for path in paths.values():
        print(f"{path}  ({sum(1 for _ in path.open())} rows)")
    return 0


def sampled_preferences(args: argparse.Namespace, config) -> int:
    """`make-preferences --from-model`: rank the model's own samples on the recipe's task with its checker."""
    import json
    from pathlib import Path

    from polo.config import ConfigError
    from polo.data import instruction_for, make_task
    from polo.data.preferences import write_jsonl
    from polo.finetune.sampled_preferences import PreferenceDraw, check_sampling_request, sampled_preference_data
    from polo.generation.grouped import GroupSampling, load_for_sampling
    from polo.runtime.device import inference_compute

    task = make_task(config)
    if not 0 < args.temperature < float("inf"):  # NaN fails this too
        raise ConfigError(
            "make-preferences --from-model: --temperature must be > 0 and finite (samples must differ), "
            f"got {args.temperature}"
        )
    draw = PreferenceDraw(
        num_prompts=args.num_prompts,
        num_prompts_eval=args.num_prompts_eval,
        max_pairs=args.max_pairs,
        seed=args.seed,
        instruction=instruction_for(config, task),
        system_prompt=config.task.system_prompt,
    )
    try:  # before the model loads: a bad count costs nothing
        check_sampling_request(task, draw, args.samples)
    except ValueError as error:
        raise ConfigError(f"make-preferences --from-model: {error}") from None
    compute = inference_compute("auto", args.device)
    model, tokenizer = load_for_sampling(args.from_model, compute)
    sampling = GroupSampling(
        samples=args.samples,
        max_new_tokens=config.sampling.max_new_tokens,
        temperature=args.temperature,
        compute=compute,
        progress=True,
        description="polo make-preferences",
    )
    splits, stats = sampled_preference_data(model, tokenizer, task, draw, sampling)
    out_dir = Path(args.out_dir)
    for name, rows in splits.items():
        print(f"{write_jsonl(out_dir / f'{name}.jsonl', rows)}  ({len(rows)} rows)")
    stats = {"model": args.from_model, "temperature": args.temperature, **stats}
    (out_dir / "sampling.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(
        f"{args.from_model}: {stats['sample_accuracy']:.3f} of {stats['prompts'] * args.samples} samples correct; "
        f"{stats['prompts_with_a_comparison']} of {stats['prompts']} prompts had both a right and a wrong answer"
    )
    return 0
