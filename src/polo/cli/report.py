"""`polo report` and `polo plot`: a run directory's HTML page and its curves."""

from __future__ import annotations

import argparse

from polo.cli.commands import COMMANDS


@COMMANDS.register("report")
def add_report_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `report` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser(
        "report",
        help="one self-contained HTML page of a run: config, curves, sample completions",
        description="Write RUN_DIR/report.html (images embedded) from a run's config.yaml, metrics.jsonl, "
        "eval_step*.json and samples.jsonl.",
    )
    parser.add_argument("run_dir")
    parser.add_argument("--output", "-o", default=None, help="HTML path (default RUN_DIR/report.html)")
    parser.add_argument(
        "--sample-steps", type=int, default=4, help="how many steps to show best/worst completions for (default 4)"
    )
    parser.set_defaults(run=run_report)
    return parser


def run_report(args: argparse.Namespace) -> int:
    """Write the run's HTML report and print its path."""
    from polo.evaluation.report import write_report

    print(write_report(args.run_dir, args.output, sample_steps=args.sample_steps))
    return 0


@COMMANDS.register("plot")
def add_plot_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `plot` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser("plot", help="draw reward/accuracy/length curves of a run directory")
    parser.add_argument("run_dir")
    parser.set_defaults(run=run_plot)
    return parser


def run_plot(args: argparse.Namespace) -> int:
    """Draw the run's curves and print each image's path."""
    from polo.evaluation.plots import check_plottable, plot_run

    check_plottable(args.run_dir)
    for path in plot_run(args.run_dir):
        print(path)
    return 0
