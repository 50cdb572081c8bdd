"""The `polo pipeline` subcommand: a multi-stage recipe (DeepSeek-R1's cold start, GRPO, rejection sampling, GRPO).

A thin wrapper over `polo.pipeline.run_pipeline`; `polo.cli` calls `add_parser(subcommands)` to
register it and `run(args)` to execute it.
"""

from __future__ import annotations

import argparse

from polo.cli.config import KeyHelp
from polo.runtime.device import DEVICE_HELP


def add_parser(subcommands) -> None:
    """Add the `pipeline` subcommand to an argparse subparsers object."""
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
    parser.add_argument("recipe", help="path to a pipeline recipe (e.g. recipes/r1_arith.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="dotted.key=value overrides, e.g. pipeline.dir=runs/r1 stages.reason.train.steps=10",
    )
    parser.add_argument(
        "--device", default=None, help=f"{DEVICE_HELP}; the same as pipeline.device=... (default: the recipe's)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the pipeline the arguments name; return the exit status."""
    from polo.pipeline import run_pipeline

    overrides = [*args.overrides, f"pipeline.device={args.device}"] if args.device is not None else args.overrides
    result = run_pipeline(args.recipe, overrides)
    if result.report is not None:
        print(f"report: {result.report}")
    return 0
