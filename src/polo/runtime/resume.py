"""What a resume checks before it loads anything: which checkpoint is intact, and whether the recipe still means
the same run.

A checkpoint is checked without loading the model: each safetensors file's header must describe
exactly the bytes the file holds, and `trainer_state.pt` must open (memory-mapped, so its tensors
are not read). A damaged checkpoint is named and set aside, and the run goes on from the newest
intact one.

The keys that define a run (the model, the algorithm and its registered parts, the group size,
the task and its data) are compared with the recipe the checkpoint was trained under (the
`config.yaml` each checkpoint holds; the run directory's for a checkpoint written before
checkpoints held one). A change is refused in one line, unless the recipe names the key in its
list of allowed changes; an allowed change is appended to `config_changes.jsonl` with the step
it took effect at, and the run directory's `config.yaml` keeps the value the run started with,
with a comment line per change, so that neither it nor a model card claims the whole run used
the new value.

Every function here reads or writes only files: each command's run lifecycle calls them with its
own keys.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml

from polo.config import ConfigError

CHANGES_FILE = "config_changes.jsonl"
RECIPE_FILE = "config.yaml"  # the recipe, in the run directory and in each checkpoint
TRAINER_STATE = "trainer_state.pt"
DAMAGED_PREFIX = "damaged-"  # a damaged checkpoint step-N is renamed damaged-step-N: no longer found, still there


class ResumeRefusedError(ConfigError):
    """The recipe changes what the run means; nothing was loaded or written."""


class RunFinishedError(Exception):
    """The run in the output directory is finished: there is nothing to resume (not an error)."""


def step_of(checkpoint: Path) -> int:
    """Return the step a checkpoint directory `step-NNNNNN` holds."""
    return int(Path(checkpoint).name.split("-")[-1])


def finished_run(checkpoint: Path, steps: int, output_dir: Path) -> RunFinishedError | None:
    """Return the news that resuming from `checkpoint` has nothing left to do with `steps` steps, or None when it has.

    A run is finished when its checkpoint is past `steps`, or at `steps` with the model card its
    end writes (README.md): a checkpoint at `steps` without one was saved by a stop before the
    final evaluation, which the resume then does.
    """
    step = step_of(checkpoint)
    if step < steps or (step == steps and not (Path(checkpoint) / "README.md").is_file()):
        return None
    return RunFinishedError(
        f"polo: output.dir {output_dir} holds a finished run ({Path(checkpoint).name}, train.steps={steps}): "
        "nothing to resume; raise train.steps to train on, or start again with output.overwrite=true"
    )


def safetensors_problem(path: Path) -> str | None:
    """Return what is wrong with a safetensors file (truncated, a bad header), or None when it is whole.

    A safetensors file is an 8-byte little-endian header length N, N bytes of JSON naming each
    tensor's [begin, end) byte range, then the data: the file is whole when its size is
    8 + N + the largest end. Only the header is read.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{path.name} is truncated ({size} bytes, not even a header)"
        (header_length,) = struct.unpack("<Q", head)
        if 8 + header_length > size:
            return f"{path.name} is truncated ({size:,} bytes, its header alone needs {8 + header_length:,})"
        try:
            header = json.loads(handle.read(header_length))
        except ValueError:
            return f"{path.name} has an unreadable header"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected = 8 + header_length + max(ends, default=0)
    if size != expected:
        return (
            f"{path.name} is truncated ({size:,} of {expected:,} bytes)"
            if size < expected
            else (f"{path.name} has {size - expected:,} bytes more than its header describes")
        )
    return None


def open_trainer_state(checkpoint: Path) -> dict:
    """Return a checkpoint's trainer state memory-mapped (its tensors are not read), or read whole where mmap is not to
    be had; raise what torch raises for a damaged file."""
    state = Path(checkpoint) / TRAINER_STATE
    try:
        return torch.load(state, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # a truncated zip fails here (its central directory is at the end), or mmap is not to be had
        return torch.load(state, map_location="cpu", weights_only=False)


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Return what makes `checkpoint` unusable (a missing or damaged file, named), or None when it is intact.

    Reads the safetensors headers and opens `trainer_state.pt` memory-mapped: the weights are
    never loaded, so checking costs a small fraction of resuming.
    """
    checkpoint = Path(checkpoint)
    state = checkpoint / TRAINER_STATE
    if not state.is_file():
        return f"{TRAINER_STATE} is missing"
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        return "it holds no weights (no .safetensors file)"
    for index in checkpoint.glob("*.safetensors.index.json"):  # a sharded model names its shards
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(shard for shard in shards if not (checkpoint / shard).is_file())
        if missing:
            return f"{missing[0]} is missing (named in {index.name})"
    for path in weights:
        problem = safetensors_problem(path)
        if problem is not None:
            return problem
    try:
        open_trainer_state(checkpoint)
    except Exception as error:
        reason = " ".join(str(error).split())[:120]
        return f"{TRAINER_STATE} cannot be read ({type(error).__name__}: {reason})"
    return None


@dataclass(frozen=True)
class Damaged:
    """A checkpoint that cannot be resumed from, and why."""

    checkpoint: Path
    problem: str


def newest_intact(root: Path) -> tuple[Path | None, list[Damaged]]:
    """Return (the newest intact checkpoint under `root` or None, the damaged ones newer than it, newest first).

    Every `step-*` directory counts, with or without its `trainer_state.pt`: a checkpoint is
    written whole or not at all (`polo.runtime.checkpoint.staged_directory`), so one that lacks
    a file was damaged after it was written.
    """
    damaged = []
    for checkpoint in sorted(Path(root).glob("step-*"), key=step_of, reverse=True):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint, damaged
        damaged.append(Damaged(checkpoint, problem))
    return None, damaged


def damaged_line(damaged: Damaged, fallback: Path | None) -> str:
    """Return the one line that names a damaged checkpoint and where the run goes on from."""
    then = f"resuming from {fallback.name}" if fallback is not None else "no intact checkpoint is left"
    return (
        f"polo: warning: checkpoint {damaged.checkpoint} is damaged ({damaged.problem}); set aside as "
        f"{DAMAGED_PREFIX}{damaged.checkpoint.name}, {then}"
    )


def set_aside(damaged: Damaged) -> Path:
    """Rename a damaged checkpoint so that no later search or rotation takes it for a checkpoint; return its new
    path."""
    target = damaged.checkpoint.with_name(DAMAGED_PREFIX + damaged.checkpoint.name)
    if target.exists():  # set aside before, and written again since: keep the newer damage for a look
        target = target.with_name(f"{target.name}-{datetime.now():%Y%m%d%H%M%S}")
    damaged.checkpoint.rename(target)
    return target


# ------------------------------------------------------------------ does the recipe still mean the same run


def check_command(checkpoint: Path, command: str) -> None:
    """Raise `ResumeRefusedError` in one line when another command (`polo rm` for `polo sft`) wrote `checkpoint`.

    A checkpoint written before checkpoints named their command cannot be compared and passes.
    No setting allows this change: one command's weights and state are not another's.
    """
    written_by = open_trainer_state(checkpoint).get("command")
    if written_by is not None and written_by != command:
        raise ResumeRefusedError(
            f"cannot resume from {checkpoint}: {written_by} wrote it, this is {command}; pick another output.dir, "
            "or start again there with output.overwrite=true"
        )


@dataclass(frozen=True)
class Change:
    """A key whose value differs between the run's recipe and this one."""

    key: str
    was: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.key} {self.was!r} -> {self.now!r}"


_MISSING = object()


def lookup(config: dict, key: str) -> Any:
    """Return the value at dotted `key` in a nested config mapping (a private sentinel when a level is missing)."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def changed_keys(saved: dict, current: dict, keys: Sequence[str]) -> list[Change]:
    """Return the `keys` whose values differ between the `saved` recipe and the `current` one.

    A key the saved recipe does not hold (written by an older polo) cannot be compared and is
    left out.
    """
    changes = []
    for key in keys:
        was, now = lookup(saved, key), lookup(current, key)
        if was is not _MISSING and now is not _MISSING and was != now:
            changes.append(Change(key, was, now))
    return changes


def saved_recipe(checkpoint: Path, output_dir: Path) -> dict | None:
    """Return the recipe `checkpoint` was trained under: its own config.yaml, else the run directory's (None: neither
    exists)."""
    for path in (Path(checkpoint) / RECIPE_FILE, Path(output_dir) / RECIPE_FILE):
        if path.is_file():
            return yaml.safe_load(path.read_text()) or {}
    return None


def check_changes(changes: list[Change], allowed: Sequence[str], checkpoint: Path, setting: str) -> list[Change]:
    """Return the allowed `changes`; raise `ResumeRefusedError` in one line naming each other key and both its values.

    `setting` is the recipe key that lists the allowed changes (output.allow_changes).
    """
    refused = [change for change in changes if change.key not in allowed]
    if refused:
        what = "; ".join(f"{change.key} was {change.was!r} in the run, {change.now!r} here" for change in refused)
        keys = ",".join(change.key for change in refused)
        raise ResumeRefusedError(
            f"cannot resume from {checkpoint}: the recipe changes what the run means ({what}); set it back, "
            f"or say the change is meant with {setting}=[{keys}] (it is recorded in {CHANGES_FILE})"
        )
    return [change for change in changes if change.key in allowed]


def record_changes(output_dir: Path, step: int, changes: list[Change]) -> None:
    """Append each allowed change, with the step it takes effect after, to the run's config_changes.jsonl."""
    if not changes:
        return
    when = datetime.now().astimezone().isoformat(timespec="seconds")
    rows = [{"step": step, "key": change.key, "was": change.was, "now": change.now, "time": when} for change in changes]
    with open(Path(output_dir) / CHANGES_FILE, "a") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)


def recorded_changes(output_dir: Path) -> list[dict]:
    """Return the rows of the run's config_changes.jsonl, oldest first (empty when no change was ever allowed)."""
    path = Path(output_dir) / CHANGES_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def forget_changes_from(output_dir: Path, step: int) -> None:
    """Drop the recorded changes that took effect after step `step` or later: a resume from checkpoint `step` re-does
    the steps they applied to, and records its own changes again."""
    rows = recorded_changes(output_dir)
    kept = [row for row in rows if row["step"] < step]
    if len(kept) != len(rows):
        text = "".join(json.dumps(row) + "\n" for row in kept)
        (Path(output_dir) / CHANGES_FILE).write_text(text)


def started_recipe(current: dict, output_dir: Path) -> tuple[dict, str]:
    """Return (the run's recipe with each changed key at the value the run started with, one comment line per change).

    This is what the run directory's config.yaml and a model card say: the recipe the run
    started from, and when each allowed change took effect, never a later value as if the whole
    run had used it.
    """
    rows = recorded_changes(output_dir)
    started = json.loads(json.dumps(current))  # a deep copy of plain YAML values
    for row in reversed(rows):  # the oldest change's `was` wins: the value the run started with
        parts = row["key"].split(".")
        section = started
        for part in parts[:-1]:
            section = section.setdefault(part, {})
        section[parts[-1]] = row["was"]
    comments = "".join(
        f"# after step {row['step']} the run went on with {row['key']}: {row['now']!r} (was {row['was']!r}; "
        f"{CHANGES_FILE})\n"
        for row in rows
    )
    return started, comments


def recipe_text(current: dict, output_dir: Path) -> str:
    """Return the text of the run directory's config.yaml: the change comments, then the started recipe as YAML."""
    started, comments = started_recipe(current, output_dir)
    return comments + yaml.safe_dump(started, sort_keys=False)
