"""The `polo` subcommands by name: each module of `polo.cli` registers its own.

A registered entry is `add_parser(subcommands) -> argparse.ArgumentParser`: it adds the command's
parser, and the parser's defaults carry `run(args) -> exit status`. `polo.cli.main` builds every
registered parser and calls the parsed command's `run`, so adding a command touches its own
module and the list of command modules in `polo.cli`.
"""

from __future__ import annotations

import argparse

from polo.core.registry import Registry

COMMANDS = Registry("command")


def add_recipe_arguments(parser: argparse.ArgumentParser, example: str, overrides_help: str) -> None:
    """Add a training command's `RECIPE [dotted.key=value ...]`; `example` is the recipe its missing-recipe line
    suggests."""
    # Optional to argparse, so a bare `polo train` gets polo's own line naming an example rather than argparse's
    # "the following arguments are required".
    parser.add_argument("recipe", nargs="?", help=f"path to a YAML recipe, e.g. {example}")
    parser.add_argument("overrides", nargs="*", help=overrides_help)
    parser.set_defaults(example_recipe=example)


def missing_recipe(args: argparse.Namespace) -> str | None:
    """Return the line for a training command given no recipe (None when it has one, or takes none)."""
    example = getattr(args, "example_recipe", None)
    if example is None or args.recipe is not None:
        return None
    return (
        f"polo {args.command} needs a recipe: polo {args.command} RECIPE.yaml [dotted.key=value ...], e.g. "
        f"polo {args.command} {example} (polo config {args.command}: every key; polo {args.command} --help)"
    )
