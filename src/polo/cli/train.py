"""`polo train RECIPE.yaml [dotted.key=value ...]`: a thin wrapper over `polo.train`."""

from __future__ import annotations

import argparse
import os

from polo.cli.commands import COMMANDS, add_recipe_arguments
from polo.cli.config import KeyHelp


@COMMANDS.register("train")
def add_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `train` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser(
        "train",
        help="train a language model with a recipe",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-h",
        "--help",
        action=KeyHelp,
        command="train",
        help="show this help, with the tasks and answer checkers, and exit; with KEY (e.g. algorithm.beta or "
        "algorithm), that key's or section's default, range and help",
    )
    add_recipe_arguments(
        parser, "recipes/grpo_arith.yaml", "dotted.key=value overrides, e.g. train.steps=10 output.resume=true"
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Train with the recipe and overrides the arguments name; print the held-out accuracy before and after."""
    from polo.rl.train import train

    result = train(args.recipe, args.overrides)
    rank_zero = os.environ.get("RANK", "0") == "0"  # under torchrun only the first process reports
    if result.eval_before is not None and result.eval_after is not None and rank_zero:
        print(f"held-out accuracy: {result.eval_before['accuracy']:.3f} -> {result.eval_after['accuracy']:.3f}")
    return 0
