"""The docs cannot go stale: every `polo.x.y` name and every repository path cited in README.md, docs/ and
examples/ exists, and every command in the README parses as the real command line would, without training."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")])
TOP_LEVEL = ("src", "docs", "tests", "recipes", "benchmarks", "examples")

# `polo.x.y`, not part of a longer word, a file name (`.polo.lock`) or a path (`src/polo/...`).
DOTTED = re.compile(r"(?<![\w./-])polo(?:\.[A-Za-z_]\w*)+")
# A path under one of the tree's top-level folders, up to the first character no path here uses.
TREE_PATH = re.compile(rf"(?<![\w./~-])(?:{'|'.join(TOP_LEVEL)})/(?:[\w./*<>-]|\{{[\w,]*\}})*[\w/*>}}]")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path that stands for many (`recipes/<name>_arith.yaml`, `checkpoints/step-NNNNNN`) is a pattern, not a file.
PLACEHOLDER = re.compile(r"[<*{]|NNN|\.\.\.")


def cited_names(text: str) -> set[str]:
    """Return the dotted `polo.` names in `text`, without a trailing sentence period."""
    return {match.rstrip(".") for match in DOTTED.findall(text)}


def resolves(name: str) -> bool:
    """Return whether `name` is a module of polo, or an attribute reached from the longest module prefix of it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def cited_paths(document: Path, text: str) -> set[Path]:
    """Return the repository paths `document` cites: tree paths anywhere, and the targets of its relative links."""
    paths = {ROOT / match.rstrip("./") for match in TREE_PATH.findall(text) if not PLACEHOLDER.search(match)}
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:") and not PLACEHOLDER.search(target):
            paths.add((document.parent / target).resolve())
    return paths


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("document", DOCUMENTS, ids=relative)
def test_every_cited_polo_name_resolves(document):
    missing = sorted(name for name in cited_names(document.read_text()) if not resolves(name))
    assert not missing, f"{relative(document)} cites names that do not exist: {missing}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=relative)
def test_every_cited_repository_path_exists(document):
    missing = sorted(str(path) for path in cited_paths(document, document.read_text()) if not path.exists())
    assert not missing, f"{relative(document)} cites paths that do not exist: {missing}"


def anchors(document: Path) -> set[str]:
    """Return the anchors of a Markdown file's headings, as GitHub makes them ("## Faults a run survives" ->
    "faults-a-run-survives")."""
    headings = re.findall(r"^#+ (.+)$", document.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if d.suffix == ".md"], ids=relative)
def test_every_cited_section_exists(document):
    missing = []
    for target in LINK.findall(document.read_text()):
        path, _, anchor = target.partition("#")
        if anchor and "://" not in path and (not path or path.endswith(".md")):
            linked = (document.parent / path).resolve() if path else document
            if linked.exists() and anchor not in anchors(linked):
                missing.append(target)
    assert not missing, f"{relative(document)} links to sections that do not exist: {missing}"


def readme_commands() -> list[str]:
    """Return the README's shell commands: the lines of its bash blocks, without comments and continuations."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split(" #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def polo_arguments(words: list[str]) -> list[str] | None:
    """Return the arguments after `polo` (`.venv/bin/polo`, `python -m polo`, `torchrun ... -m polo`), else None."""
    if Path(words[0]).name == "polo":
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1 : words.index("-m") + 2] == ["polo"]:
        return words[words.index("-m") + 2 :]
    return None


def loader(command: str):
    """Return the function that loads and validates `command`'s recipe, as the command itself does first."""
    from polo.config import load_config
    from polo.config.finetune import load_dpo_config, load_reward_model_config, load_sft_config
    from polo.control.config import load_control_config
    from polo.pipeline.recipe import load_pipeline

    return {
        "train": load_config,
        "sft": load_sft_config,
        "rm": load_reward_model_config,
        "dpo": load_dpo_config,
        "control": load_control_config,
        "pipeline": load_pipeline,
    }.get(command)


def check_polo_command(arguments: list[str], monkeypatch) -> None:
    """Parse `polo arguments` with polo's own parser, running nothing; load and validate the recipe it names."""
    import polo.cli

    if "--help" in arguments or "-h" in arguments:  # help prints and exits 0, whatever else the line says
        with pytest.raises(SystemExit) as exit_status:
            polo.cli.main(arguments)
        assert exit_status.value.code == 0
        return
    args = polo.cli.build_parser().parse_args(arguments)  # the parser alone: the command's `run` is not called
    assert polo.cli.missing_recipe(args) is None
    load = loader(args.command)
    if load is not None:
        monkeypatch.chdir(ROOT)
        load(args.recipe, args.overrides)
    for value in vars(args).values():  # a recipe or run directory named on the line is in the tree
        if isinstance(value, str) and value.startswith(TOP_LEVEL) and not value.startswith("runs/"):
            assert (ROOT / value).exists(), f"{value} does not exist"


def check_make_command(words: list[str]) -> None:
    """`make TARGET` names a target of the Makefile."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    for target in words[1:]:
        assert target in targets, f"the Makefile has no target {target!r} (it has {sorted(targets)})"


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_parses_without_training(command, monkeypatch, capsys):
    words = shlex.split(command)
    arguments = polo_arguments(words)
    if arguments is not None:
        check_polo_command(arguments, monkeypatch)
    elif words[0] == "make":
        check_make_command(words)
    elif words[0] in ("python", "python3") and words[1].endswith(".py"):
        assert (ROOT / words[1]).exists(), f"{words[1]} does not exist"
    else:
        pytest.fail(f"the README runs a command this test cannot check: {command!r}")


def test_the_readme_is_a_front_door():
    """The README stays short enough to read at once; the history of measurements lives in docs/benchmarks.md."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_docs_benchmarks_and_the_readme_results_are_what_the_records_give():
    """docs/benchmarks.md and README.md's results block are written by benchmarks/report.py from
    benchmarks/results/*.jsonl, never by hand: `report.py --check` finds both current."""
    spec = importlib.util.spec_from_file_location("benchmark_report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.main(["--check"]) == 0, "run: python benchmarks/report.py"


@pytest.mark.parametrize("document", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=relative)
def test_every_python_example_in_the_docs_is_valid_python(document):
    for block in re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.S):
        ast.parse(block)
