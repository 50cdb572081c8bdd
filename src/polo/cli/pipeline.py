"""The `polo pipeline` subcommand: a multi-stage recipe (DeepSeek-R1's cold start, GRPO, rejection sampling, GRPO).

A thin wrapper over `polo.pipeline` (`polo.pipeline.run_pipeline`).
"""

from __future__ import annotations

import argparse

from polo.cli.commands import COMMANDS, add_recipe_arguments
from polo.cli.config import KeyHelp
from polo.config.schema import DEVICE_HELP


@COMMANDS.register("pipeline")
def add_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `pipeline` subcommand to an argparse subparsers object; return its parser."""
    help_text = (
        "run a multi-stage recipe (R1: cold-start SFT, GRPO, rejection-sampling SFT, GRPO), each stage a polo run"
    )
    parser = subcommands.add_parser(
        "pipeline",
        help=help_text,
        description=help_text
        + ". A finished stage is skipped when the pipeline runs again; an interrupted GRPO stage continues. "
        "See docs/r1.md.",
        add_help=False,
    )
    parser.add_argument("-h", "--help", action=KeyHelp, command="pipeline")
    add_recipe_arguments(
        parser,
        "recipes/r1_arith.yaml",
        "dotted.key=value overrides, e.g. pipeline.dir=runs/r1 stages.reason.train.steps=10",
    )
    parser.add_argument(
        "--device", default=None, help=f"{DEVICE_HELP}; the same as pipeline.device=... (default: the recipe's)"
    )
    # Running the same command again skips the finished stages and continues an interrupted one.
    parser.set_defaults(run=run, rerun_continues=True)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the pipeline the arguments name through `polo.pipeline`; return the exit status."""
    import polo

    overrides = [*args.overrides, f"pipeline.device={args.device}"] if args.device is not None else args.overrides
    result = polo.pipeline(args.recipe, overrides)
    if result.report is not None:
        print(f"report: {result.report}")
    return 0
