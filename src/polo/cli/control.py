"""The `polo control` subcommand: `polo control RECIPE.yaml [dotted.key=value ...]`."""

from __future__ import annotations

import argparse

from polo.cli.commands import COMMANDS, add_recipe_arguments
from polo.cli.config import KeyHelp


@COMMANDS.register("control")
def add_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `control` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser(
        "control", help="train a policy on a Gymnasium control task with a recipe", add_help=False
    )
    parser.add_argument("-h", "--help", action=KeyHelp, command="control")
    add_recipe_arguments(
        parser, "recipes/ppo_cartpole.yaml", "dotted.key=value overrides, e.g. train.seed=3 algorithm.name=a2c"
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run `polo control` for parsed `args` through `polo.control`; return the exit status."""
    import polo

    result = polo.control(args.recipe, args.overrides)
    last = result.last_mean()
    summary = f"{result.env_steps:,} steps in {result.seconds:.1f} s; mean return of the last 20 episodes: "
    summary += "n/a" if last is None else f"{last:.1f}"
    if result.solved_at_step is not None:
        summary += f"; solved after {result.solved_at_step:,} steps ({result.solved_at_seconds:.1f} s)"
    print(summary)
    return 0
