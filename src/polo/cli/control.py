"""The `polo control` subcommand: `polo control RECIPE.yaml [dotted.key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from polo.cli.config import KeyHelp


def add_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `control` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser(
        "control", help="train a policy on a Gymnasium control task with a recipe", add_help=False
    )
    parser.add_argument("-h", "--help", action=KeyHelp, command="control")
    parser.add_argument("recipe", help="path to a YAML recipe, e.g. recipes/ppo_cartpole.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.seed=3 algorithm.name=a2c")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run `polo control` for parsed `args`; return the exit status (2 for a bad recipe)."""
    from polo.config import ConfigError
    from polo.control.trainer import train

    try:
        result = train(args.recipe, args.overrides)
    except (ConfigError, FileNotFoundError) as error:
        print(f"polo: error: {error}", file=sys.stderr)
        return 2
    last = result.last_mean()
    summary = f"{result.env_steps:,} steps in {result.seconds:.1f} s; mean return of the last 20 episodes: "
    summary += "n/a" if last is None else f"{last:.1f}"
    if result.solved_at_step is not None:
        summary += f"; solved after {result.solved_at_step:,} steps ({result.solved_at_seconds:.1f} s)"
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `polo control` on its own (python -m polo.cli.control RECIPE ...)."""
    parser = argparse.ArgumentParser(prog="polo")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["control", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
