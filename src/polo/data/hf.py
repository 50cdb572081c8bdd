"""Hugging Face ``datasets`` as a task source: the ``hf`` task.

The rows come from ``task.path``, which names one of

- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``load_from_disk``);
- a data file, ``.parquet``, ``.json``, ``.jsonl`` or ``.csv`` (``load_dataset(<builder>,
  data_files=...)``, the builder chosen from the extension): its rows are the "train" split, and
  ``task.eval_path``, a second file, the "test" split;
- a directory of such files (``load_dataset(<directory>)``; splits from the file names, e.g.
  ``train.parquet`` and ``test.parquet``);
- a Hub dataset id such as ``openai/gsm8k`` (``task.subset``: its configuration), when online;

or from ``datasets.Dataset`` objects (or lists of dicts) passed to ``polo.train(config,
train_dataset=..., eval_dataset=...)``. Every row goes through the jsonl task's row contract
(`polo.data.jsonl.task_row`), so the same data gives the same rows either way.

The train rows are ``task.split`` (default "train"). The eval rows are ``task.eval_split`` when
set, else the "test" split when there is one (TRL's ``dataset_test_split`` default), else the
last ``task.num_eval`` rows of the train split, held out (none when ``num_eval`` is 0 or null);
for datasets passed from Python, ``eval_dataset``, else the same hold-out. ``num_train`` and
``num_eval`` keep the first rows otherwise, as for jsonl.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polo.config.schema import ConfigError
from polo.core.registry import register_task
from polo.data.base import Task, TaskDataError, first_rows
from polo.data.jsonl import TRL_ANSWER_FIELD, TRL_PROMPT_FIELD, prompt_instruction, row_fields, task_rows
from polo.rewards.answers import checker as bind_checker

# The datasets builder for each data file extension.
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
DEFAULT_EVAL_SPLIT = "test"
# "owner/name" or "name": what may be a Hub dataset id rather than a mistyped local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _load_local(path: Path, eval_path: str | None) -> Any:
    """Return what datasets loads from a local save_to_disk directory, data file or data directory."""
    import datasets

    if eval_path is not None and not path.is_file():
        raise ConfigError(
            "task.eval_path: with task.name=hf it names the eval data file beside a task.path data file; "
            f"task.path {path} is a directory"
        )
    if path.is_dir() and any((path / name).is_file() for name in ("dataset_dict.json", "state.json")):
        return datasets.load_from_disk(str(path))
    if path.is_dir():
        return datasets.load_dataset(str(path))
    files = {"train": str(path)}
    if eval_path is not None:
        if not Path(eval_path).expanduser().is_file():
            raise ConfigError(f"task.eval_path: no such file: {eval_path}")
        if Path(eval_path).suffix.lower() != path.suffix.lower():
            raise ConfigError(f"task.eval_path: {eval_path} must be a {path.suffix} file like task.path {path}")
        files[DEFAULT_EVAL_SPLIT] = str(Path(eval_path).expanduser())
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ConfigError(
            f"task.path: {path} is not a data file datasets reads; use one ending in {', '.join(BUILDERS)}, "
            "or a directory"
        )
    return datasets.load_dataset(builder, data_files=files)


def load_splits(path: str, subset: str | None = None, eval_path: str | None = None) -> dict[str, Any]:
    """Return the splits of the dataset ``task.path`` names, by split name (a lone Dataset is "train")."""
    import datasets

    local = Path(path).expanduser()
    if subset is not None and local.exists():
        raise ConfigError(
            f"task.subset: {subset!r} names a configuration of a Hub dataset; task.path {path} is local "
            "(set task.subset: null)"
        )
    if local.exists():
        try:
            loaded = _load_local(local, eval_path)
        except (ConfigError, TaskDataError):
            raise
        except Exception as error:
            raise TaskDataError(path, None, f"datasets could not read it: {type(error).__name__}: {error}") from error
    elif _HUB_ID.fullmatch(path) is None or local.suffix.lower() in BUILDERS:
        raise ConfigError(
            f"task.path: {path} is neither a local file or directory nor a Hugging Face Hub dataset id (owner/name)"
        )
    else:
        try:
            loaded = datasets.load_dataset(path, subset)
        except Exception as error:
            raise ConfigError(
                f"task.path: {path} is not a local file or directory, and loading it from the Hugging Face Hub failed: "
                f"{type(error).__name__}: {error}"
            ) from error
    return {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)


def pick_splits(splits: dict[str, Any], split: str, eval_split: str | None, source: str) -> tuple[Any, Any | None]:
    """Return (train split, eval split or None) of ``splits`` by the task's split settings."""
    names = sorted(splits)
    if split not in splits:
        raise ConfigError(f"task.split: {split!r} is not a split of {source}; its splits: {names}")
    if eval_split is None:
        return splits[split], splits.get(DEFAULT_EVAL_SPLIT) if split != DEFAULT_EVAL_SPLIT else None
    if eval_split not in splits:
        raise ConfigError(
            f"task.eval_split: {eval_split!r} is not a split of {source}; its splits: {names} "
            f"(null: {DEFAULT_EVAL_SPLIT!r} if present, else held-out train rows)"
        )
    if eval_split == split:
        raise ConfigError(f"task.eval_split: {eval_split!r} is also task.split; held-out rows must not be trained on")
    return splits[split], splits[eval_split]


def numbered_rows(data: Any, source: str) -> list[tuple[int, Any]]:
    """Return ``(row index, row)`` for a ``datasets.Dataset`` or a list of dicts; refuse anything else in one line."""
    if isinstance(data, Mapping):
        splits = f" (splits {sorted(data)})" if all(hasattr(value, "column_names") for value in data.values()) else ""
        raise ConfigError(
            f"{source} is a mapping{splits}; pass one split, e.g. train_dataset=dataset['train'], "
            "eval_dataset=dataset['test']"
        )
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return list(enumerate(data))
    if hasattr(data, "column_names") and hasattr(data, "__len__") and hasattr(data, "to_list"):
        return list(enumerate(data.to_list()))  # a datasets.Dataset: one dict per row, converted in one batch
    raise ConfigError(
        f"{source} must be a datasets.Dataset or a list of dicts, got {type(data).__name__} "
        "(a streaming IterableDataset cannot be used)"
    )


def dataset_rows(
    data: Any, source: str, prompt_field: str | None, answer_field: str | None, checker_name: str
) -> list[dict]:
    """Return the task rows of one split (a Dataset or a list of dicts), through the jsonl task's row contract."""
    columns = getattr(data, "column_names", None)
    if isinstance(columns, list):  # a Dataset: a missing column is missing from every row, so say so once
        found = row_fields(columns, prompt_field, answer_field)
        for key, configured, field, trl in (
            ("task.prompt_field", prompt_field, found[0], TRL_PROMPT_FIELD),
            ("task.answer_field", answer_field, found[1], TRL_ANSWER_FIELD),
        ):
            if field not in columns:
                named = repr(field) if configured is not None else f"{field!r} (or TRL's {trl!r})"
                raise ConfigError(f"{source}: no column {named} ({key}); its columns: {columns}")
    return task_rows(numbered_rows(data, source), prompt_field, answer_field, checker_name, source, unit="row")


def split_train_eval(
    train: list[dict],
    held_out: list[dict] | None,
    num_train: int | None,
    num_eval: int | None,
    source: str,
    eval_source: str,
) -> tuple[list[dict], list[dict]]:
    """Return (train rows, eval rows): the eval split's first ``num_eval``, else the last ``num_eval`` train rows
    held out."""
    if held_out is not None:
        held_out = first_rows(held_out, num_eval, f"hf eval {eval_source}", "task.num_eval", "the dataset")
    else:
        count = 0 if num_eval is None else num_eval
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"hf {source}: task.num_eval must be null or an integer >= 0, got {num_eval!r}")
        if count and count >= len(train):
            raise ConfigError(
                f"task.num_eval is {count} but {source} holds only {len(train)} rows and there is no eval split "
                f"to hold them out of; set task.num_eval below {len(train)} (0 for no held-out rows), or give an "
                "eval split"
            )
        train, held_out = train[: len(train) - count], train[len(train) - count :]
    return first_rows(train, num_train, f"hf train {source}", "task.num_train", "the dataset"), held_out


@dataclass(frozen=True)
class HfSource:
    """Where the hf task's rows come from: ``path`` (with its ``subset``, ``split``, ``eval_split`` and
    ``eval_path``), or datasets passed in (``train_dataset``, ``eval_dataset``); the module docstring says how."""

    path: str | None = None
    split: str = "train"
    eval_split: str | None = None
    eval_path: str | None = None
    subset: str | None = None
    train_dataset: Any = None
    eval_dataset: Any = None


@register_task("hf", help="Hugging Face datasets")
def hf_task(
    source: HfSource = HfSource(),
    prompt_field: str | None = None,
    answer_field: str | None = None,
    num_train: int | None = None,
    num_eval: int | None = None,
    answer_in_tags: bool = False,
    checker: str = "math_verify",
) -> Task:
    """Return a Task over a Hugging Face dataset (``source.path``) or Datasets / lists of dicts passed in (``source``'s
    datasets), judged by ``checker``.

    The module docstring says where the rows come from and how the eval rows are chosen.
    """
    correctness = bind_checker(checker, answer_in_tags)  # validates the name before any I/O
    fields = (prompt_field, answer_field, checker)
    train, held_out, where, eval_where = _source_rows(source, fields)
    train_rows, eval_rows = split_train_eval(train, held_out, num_train, num_eval, where, eval_where)
    return Task(
        name="hf",
        train_rows=train_rows,
        eval_rows=eval_rows,
        correctness=correctness,
        instruction=prompt_instruction(train_rows, answer_in_tags),
        sources=(where, eval_where if held_out is not None else f"{where} (its last rows, held out)"),
    )


def _source_rows(
    source: HfSource, fields: tuple[str | None, str | None, str]
) -> tuple[list[dict], list[dict] | None, str, str]:
    """Return (train rows, eval split rows or None, where each came from) of ``source``, through the row contract."""
    path, split, eval_split = source.path, source.split, source.eval_split
    if source.train_dataset is not None:
        for key, value in (("task.path", path), ("task.eval_path", source.eval_path)):
            if value is not None:
                raise ConfigError(
                    f"{key} is {value!r} and a train_dataset was passed too; pass one ({key}: null with train_dataset)"
                )
        train = dataset_rows(source.train_dataset, "train_dataset", *fields)
        eval_dataset = source.eval_dataset
        held_out = None if eval_dataset is None else dataset_rows(eval_dataset, "eval_dataset", *fields)
        return train, held_out, "train_dataset", "eval_dataset"
    if source.eval_dataset is not None:
        raise ConfigError("eval_dataset was passed without train_dataset; pass both, or neither and set task.path")
    if path is None:
        raise ConfigError(
            "task.path: the hf task needs a dataset: a save_to_disk directory, a data file or directory, or a Hub id, "
            "or datasets passed to polo.train(config, train_dataset=...); a run recorded with task.path null was "
            "trained on such datasets: pass the same ones again"
        )
    splits = load_splits(str(path), source.subset, source.eval_path)
    train_split, eval_split_data = pick_splits(splits, split, eval_split, str(path))
    train = dataset_rows(train_split, f"{path} split {split!r}", *fields)
    eval_where = f"{path} split {eval_split or DEFAULT_EVAL_SPLIT!r}"
    held_out = None if eval_split_data is None else dataset_rows(eval_split_data, eval_where, *fields)
    return train, held_out, f"{path} split {split!r}", eval_where


# ------------------------------------------------------------ datasets passed from Python: the record in config.yaml

_FINGERPRINT = re.compile(r"rows sha256 ([0-9a-f]{64})")


def rows_sha256(*splits: list) -> str:
    """Return the sha256 of rows given from Python, split after split (what a resumed run must see again)."""
    text = json.dumps(list(splits), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def rows_fingerprint(task: Task) -> str:
    """Return the sha256 of the task's train and eval rows."""
    return rows_sha256(task.train_rows, task.eval_rows)


def passed_datasets_note(task: Task) -> str:
    """Return the YAML comment that heads config.yaml when the rows came from datasets passed to polo.train."""
    return (
        f"# task: rows from datasets passed to polo.train (train_dataset, eval_dataset or held-out rows), not from\n"
        f"# task.path (hence null): {len(task.train_rows)} train rows, {len(task.eval_rows)} eval rows, "
        f"rows sha256 {rows_fingerprint(task)}.\n"
        "# output.resume=true continues this run only with the same datasets passed again.\n"
    )


def check_same_datasets(config_path: Path, task: Task) -> None:
    """Raise ConfigError unless the run whose config.yaml is ``config_path`` was trained on the same passed rows."""
    check_same_rows(config_path, rows_fingerprint(task))


def check_same_rows(config_path: Path, fingerprint: str) -> None:
    """Raise ConfigError unless the run whose config.yaml is ``config_path`` records rows passed from Python whose
    sha256 is ``fingerprint`` (its note's ``rows sha256``)."""
    recorded = _FINGERPRINT.search(config_path.read_text()) if config_path.is_file() else None
    run_dir = config_path.parent
    if recorded is None:
        raise ConfigError(
            f"output.resume: the run in {run_dir} was not trained on datasets passed from Python (its config.yaml "
            "records none); resume it without train_dataset/eval_dataset, or pick a new output.dir"
        )
    if recorded.group(1) != fingerprint:
        raise ConfigError(
            f"output.resume: the run in {run_dir} was trained on other rows (sha256 {recorded.group(1)[:12]}, "
            f"these are {fingerprint[:12]}); pass the same train_dataset and eval_dataset to resume it, "
            "or pick a new output.dir"
        )


__all__ = [
    "BUILDERS",
    "HfSource",
    "check_same_datasets",
    "check_same_rows",
    "hf_task",
    "load_splits",
    "passed_datasets_note",
    "rows_fingerprint",
    "rows_sha256",
]
