"""`polo config [COMMAND] [KEY]` and `polo COMMAND --help KEY`: every recipe key with its default, range and help.

Read from the fields' metadata (`polo.config.fields.setting`), the same source as the checks and
docs/config.md (`polo config --markdown > docs/config.md` writes that file).
"""

from __future__ import annotations

import argparse
import os
import sys

from polo.cli.commands import COMMANDS
from polo.config import ConfigError
from polo.config import describe as doc

RECIPE_COMMANDS = ("train", "sft", "rm", "dpo", "control", "pipeline")
PIPELINE_STAGE_SECTIONS = "stages.NAME."  # where a pipeline stage's demos and rejection settings go


def command_sections(command: str) -> list[doc.Section]:
    """Return every section of `polo COMMAND`'s recipe (imported only when asked: control needs gymnasium)."""
    if command == "train":
        from polo.config.schema import Config

        return doc.sections(Config())
    if command in ("sft", "rm", "dpo"):
        from polo.config.finetune import DPOConfig, RewardModelConfig, SFTConfig

        return doc.sections({"sft": SFTConfig, "rm": RewardModelConfig, "dpo": DPOConfig}[command]())
    if command == "control":
        from polo.control.config import ControlConfig

        return doc.sections(ControlConfig())
    if command == "pipeline":
        from polo.pipeline.recipe import DemoSettings, PipelineRecipe, RejectionSettings

        return [
            *doc.sections(PipelineRecipe()),
            *doc.sections(DemoSettings(), f"{PIPELINE_STAGE_SECTIONS}demos."),
            *doc.sections(RejectionSettings(), f"{PIPELINE_STAGE_SECTIONS}rejection."),
        ]
    raise ConfigError(f"polo config: {command!r} is not one of {', '.join(RECIPE_COMMANDS)}")


def describe(command: str, key: str = "") -> str:
    """Return what `polo config COMMAND KEY` prints: the sections or the key `key` names ("": all of them)."""
    all_sections = command_sections(command)
    found = doc.find(all_sections, key)
    if not found:
        names = ", ".join(section.key for section in all_sections if section.key and "." not in section.key)
        raise ConfigError(f"polo {command} has no key or section {key!r}; its sections: {names}")
    return f"polo {command}\n{doc.text(found)}"


def index() -> str:
    """Return what a bare `polo config` prints: each command, what it is, and its sections."""
    lines = ["Recipe keys of every command (polo config COMMAND [SECTION | KEY] shows their defaults and help):", ""]
    for command in RECIPE_COMMANDS:
        all_sections = command_sections(command)
        lines.append(f"  polo {command:<9} {all_sections[0].summary}")
        lines.append(f"  {'':<14} sections: {', '.join(section.key for section in all_sections if section.key)}")
    return "\n".join(lines)


def reference() -> str:
    """Return docs/config.md: every key of every command, as Markdown tables."""
    lines = [
        "# Configuration reference",
        "",
        "Every key of every command's recipe, with its type, default, accepted values and help. Any key can be",
        "set in the recipe (YAML sections) or on the command line as `dotted.key=value`; `polo config COMMAND",
        "[KEY]` and `polo COMMAND --help KEY` print the same. A value outside its range or choices is refused",
        "before anything loads, in one line naming the key.",
        "",
        "This file is generated from the fields' own metadata (`polo.config.fields.setting`):",
        "`polo config --markdown > docs/config.md` rewrites it, and tests/config/test_documented.py fails when it",
        "is stale.",
        "",
        "The `train` section of `polo train`, `sft`, `rm`, `dpo` and `control` is one optimizer config",
        "(`OptimizerConfig`: AdamW, its schedule and gradient clipping, built by `polo.runtime.optimizer`), with",
        "each command's own defaults; the output sections share `report_to`, `project` and `run_name` (and the",
        "Hugging Face commands `push_to_hub` and `hub_private`). A pipeline stage's sections are those of",
        "`polo train` (grpo) or `polo sft` (sft, reject_sft).",
        "",
    ]
    for command in RECIPE_COMMANDS:
        lines.append(doc.markdown(f"polo {command}", command_sections(command)))
    return "\n".join(lines).rstrip("\n") + "\n"


@COMMANDS.register("config")
def add_parser(subcommands) -> argparse.ArgumentParser:
    """Add the `config` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser(
        "config",
        help="print the recipe keys of a command with their defaults, ranges and help",
        description="Print the recipe keys of a command (default train) with their defaults, ranges and help; "
        "e.g. polo config train algorithm, polo config sft train.learning_rate, polo config algorithm.beta.",
    )
    parser.add_argument(
        "words",
        nargs="*",
        metavar="COMMAND | SECTION | KEY",
        help=f"a command ({', '.join(RECIPE_COMMANDS)}), then a key",
    )
    parser.add_argument("--markdown", action="store_true", help="print docs/config.md (every command) instead")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Print what `polo config` was asked for; return the exit status."""
    words = list(args.words)
    if args.markdown:
        text = reference().rstrip("\n")
    elif not words:
        text = index()
    else:
        command = words.pop(0) if words[0] in RECIPE_COMMANDS else "train"
        if len(words) > 1:
            raise ConfigError(f"polo config: one section or key at a time, got {' '.join(words)}")
        text = describe(command, words[0] if words else "")
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `polo config | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


class KeyHelp(argparse.Action):
    """`-h/--help [KEY]` of a training command: the usual help, or the default, range and help of one key or section."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, command: str = "train", **kwargs):
        self.command = command
        kwargs.setdefault("help", "show this help and exit; with KEY (e.g. train.learning_rate), that key's help")
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs="?", metavar="KEY", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values:
            try:
                print(describe(self.command, values))
            except ConfigError as error:
                parser.exit(2, f"polo: error: {error}\n")
            parser.exit()
        if self.command == "train":
            parser.epilog = train_epilog()
        parser.print_help()
        parser.exit()


def train_epilog() -> str:
    """Return the end of `polo train -h`: the tasks and answer checkers (read only when asked: math-verify loads
    slowly)."""
    from polo.data import TASKS
    from polo.rewards.answers import DEFAULT_CHECKER, checker_help

    return (
        "every recipe key, its default and help: polo train --help KEY, polo config train [SECTION], docs/config.md\n\n"
        f"tasks (task.name): {', '.join(TASKS)}; see README.md and docs/tasks.md\n\n"
        f"answer checkers (task.checker, for the jsonl and hf tasks; default {DEFAULT_CHECKER}):\n{checker_help()}"
    )
