"""The `polo` command line: thin wrappers over the Python API."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from polo.cli.config import KeyHelp
from polo.config import ConfigError
from polo.runtime.interrupt import RunStopped, StopNow


def main(argv: list[str] | None = None) -> int:
    """Run the `polo` command and return its exit status."""
    parser = argparse.ArgumentParser(prog="polo", description="Policy optimization from REINFORCE to GRPO.")
    commands = parser.add_subparsers(dest="command", required=True)

    train_parser = commands.add_parser(
        "train",
        help="train a language model with a recipe",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_parser.add_argument(
        "-h",
        "--help",
        action=KeyHelp,
        command="train",
        help="show this help, with the tasks and answer checkers, and exit; with KEY (e.g. algorithm.beta or "
        "algorithm), that key's or section's default, range and help",
    )
    train_parser.add_argument("recipe", help="path to a YAML recipe (see recipes/)")
    train_parser.add_argument(
        "overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=10 output.resume=true"
    )

    fetch_parser = commands.add_parser(
        "fetch-model", help="fetch a built-in model (or a Hub id org/name) into the cache"
    )
    fetch_parser.add_argument(
        "name",
        nargs="?",
        default="smollm2-135m-instruct",
        help="smollm2-135m-instruct (the default), gemma3-270m, or a Hub id",
    )

    plot_parser = commands.add_parser("plot", help="draw reward/accuracy/length curves of a run directory")
    plot_parser.add_argument("run_dir")

    from polo.cli import config as config_cli
    from polo.cli import control as control_cli
    from polo.cli import eval as eval_cli
    from polo.cli import pipeline as pipeline_cli
    from polo.cli import rlhf as rlhf_cli

    config_cli.add_parser(commands)  # config: every recipe key, its default and help
    eval_cli.add_parsers(commands)  # eval, report
    rlhf_cli.add_parsers(commands)  # sft, rm, dpo, make-preferences
    control_cli.add_parser(commands)
    pipeline_cli.add_parser(commands)  # pipeline (R1's stages)

    args = parser.parse_args(argv)
    try:
        return _run(args)
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


def _run(args: argparse.Namespace) -> int:
    from polo.cli import control as control_cli
    from polo.cli import eval as eval_cli
    from polo.cli import rlhf as rlhf_cli

    if args.command in ("eval", "report"):
        return eval_cli.run(args)
    if args.command == "config":
        from polo.cli import config as config_cli

        return config_cli.run(args)
    if args.command == "control":
        return control_cli.run(args)
    if args.command in rlhf_cli.COMMANDS:
        return rlhf_cli.run(args)
    if args.command == "pipeline":
        from polo.cli import pipeline as pipeline_cli

        return pipeline_cli.run(args)
    if args.command == "train":
        from polo.rl.train import train

        result = train(args.recipe, args.overrides)
        rank_zero = os.environ.get("RANK", "0") == "0"  # under torchrun only the first process reports
        if result.eval_before is not None and result.eval_after is not None and rank_zero:
            print(f"held-out accuracy: {result.eval_before['accuracy']:.3f} -> {result.eval_after['accuracy']:.3f}")
    elif args.command == "fetch-model":
        from polo.models.hub import is_hub_id
        from polo.models.loading import ensure_builtin_model, resolve_model_path

        print(resolve_model_path(args.name) if is_hub_id(args.name) else ensure_builtin_model(args.name))
    elif args.command == "plot":
        from polo.evaluation.plots import check_plottable, plot_run

        check_plottable(args.run_dir)
        for path in plot_run(args.run_dir):
            print(path)
    return 0


def continue_command(args: argparse.Namespace, stop: RunStopped) -> str:
    """Return the second half of the stop line: the command that continues the stopped run, or starts it again."""
    torchrun = " (in the same torchrun command)" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    if args.command == "pipeline":  # finished stages are skipped and an interrupted grpo stage continues
        device = ["--device", args.device] if args.device is not None else []
        return f"resume with: {shlex.join(['polo', 'pipeline', args.recipe, *args.overrides, *device])}{torchrun}"
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
