"""`polo fetch-model [NAME]`: a built-in model, or a Hub id, into the cache."""

from __future__ import annotations

import argparse

from polo.cli.commands import COMMANDS
from polo.config.schema import DEFAULT_MODEL


@COMMANDS.register("fetch-model")
def add_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `fetch-model` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser("fetch-model", help="fetch a built-in model (or a Hub id org/name) into the cache")
    parser.add_argument(
        "name", nargs="?", default=DEFAULT_MODEL, help=f"a built-in model or a Hub id (default {DEFAULT_MODEL})"
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the directory the model is in, after fetching it when it was not there."""
    from polo.models.hub import is_hub_id
    from polo.models.loading import ensure_builtin_model, resolve_model_path

    print(resolve_model_path(args.name) if is_hub_id(args.name) else ensure_builtin_model(args.name))
    return 0
