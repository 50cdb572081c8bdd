"""The `polo` command line: thin wrappers over the Python API."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys

from polo.cli.commands import COMMANDS, missing_recipe
from polo.config import ConfigError
from polo.runtime.interrupt import RunStopped, StopNow

# The modules whose commands `polo` has, in the order `polo -h` lists them; each registers its own in COMMANDS.
COMMAND_MODULES = ("train", "rlhf", "eval", "report", "pipeline", "control", "config", "fetch_model")


def build_parser() -> argparse.ArgumentParser:
    """Return the `polo` parser, with a subparser for every registered command."""
    from polo import __version__

    for module in COMMAND_MODULES:
        importlib.import_module(f"polo.cli.{module}")
    parser = argparse.ArgumentParser(prog="polo", description="Policy optimization from REINFORCE to GRPO.")
    parser.add_argument("--version", action="version", version=f"polo {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS.names():
        COMMANDS[name](subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `polo` command and return its exit status."""
    args = build_parser().parse_args(argv)
    if args.command is None:
        print(f"polo: give a command: {', '.join(COMMANDS.names())} (polo --help says what each does)", file=sys.stderr)
        return 2
    line = missing_recipe(args)
    if line is not None:
        print(f"polo: error: {line}", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except RunStopped as stop:  # SIGTERM, SIGHUP or Ctrl-C, after the step in progress was saved
        if os.environ.get("RANK", "0") == "0":
            print(f"polo: {stop}; {continue_command(args, stop)}", file=sys.stderr, flush=True)
        return stop.exit_status
    except StopNow as stop:
        print(f"polo: {stop}", file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:
        print("polo: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if isinstance(error, _user_errors()):
            print(f"polo: error: {one_line(error)}", file=sys.stderr)
            return 2
        raise


def continue_command(args: argparse.Namespace, stop: RunStopped) -> str:
    """Return the second half of the stop line: the command that continues the stopped run, or starts it again."""
    torchrun = " (in the same torchrun command)" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    if getattr(args, "rerun_continues", False):  # the command itself skips what is done (polo pipeline)
        device = ["--device", args.device] if args.device is not None else []
        return f"resume with: {shlex.join(['polo', args.command, args.recipe, *args.overrides, *device])}{torchrun}"
    kept = [item for item in args.overrides if not item.startswith(("output.resume=", "output.overwrite="))]
    words = ["polo", args.command, args.recipe, *kept]
    if stop.resumable and stop.checkpoint is not None:
        return f"resume with: {shlex.join([*words, 'output.resume=true'])}{torchrun}"
    why = f"polo {args.command} cannot resume" if not stop.resumable else "no checkpoint was written yet"
    return f"{why}; start it again with: {shlex.join([*words, 'output.overwrite=true'])}{torchrun}"


def one_line(error: BaseException) -> str:
    """Return an error's message on one line (some libraries' messages span several)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def _user_errors() -> tuple[type, ...]:
    """The exceptions that mean a bad input (recipe, path, data file, model directory), not a bug in polo."""
    from polo.data.base import TaskDataError
    from polo.evaluation.plots import PlotError
    from polo.models.loading import ModelLoadError
    from polo.rewards import RewardFunctionError
    from polo.runtime.checkpoint import SaveError
    from polo.runtime.errors import NonFiniteLossError
    from polo.sandbox.runner import SandboxError

    paths = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
    return (
        ConfigError,
        *paths,
        ModelLoadError,
        NonFiniteLossError,
        SaveError,
        RewardFunctionError,
        TaskDataError,
        PlotError,
        SandboxError,
    )


if __name__ == "__main__":
    sys.exit(main())
