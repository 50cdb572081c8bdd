"""Experiment trackers a run reports to (`output.report_to`): one small sink class each, behind `Sink`.

`MetricsLogger` always writes metrics.jsonl itself (polo's plots, report and resume read it) and
fans the same scalars of every row out to the sinks here, and each step's completions table
to the sinks that keep tables. A tracker's package is imported only when it is asked for
(`pip install 'polo[wandb]'`, `'polo[mlflow]'`, `'polo[trackio]'`, or `'polo[trackers]'` for all),
and nothing leaves the machine unless the user says so:

    tensorboard  <output.dir>/tensorboard/
    wandb        offline run under <store>/wandb/ (WANDB_MODE, WANDB_DIR, when set, win)
    mlflow       sqlite:///<store>/mlflow.db, artifacts in <store>/mlruns/ (MLFLOW_TRACKING_URI, when set, wins)
    trackio      trackio's local database (TRACKIO_DIR, default ~/.cache/huggingface/trackio; no Space)

<store> is `output.tracker_dir`, else `output.dir` (a pipeline puts every stage's runs in its own
directory). A resumed run (`output.resume=true`) is a new tracker run under the same name.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    """Where a run's metrics go besides metrics.jsonl."""

    tables: bool  # whether `log_table` keeps anything (the completions table is built only for such a sink)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None: ...

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None: ...

    def close(self) -> None: ...


@dataclass
class Trackers:
    """Which trackers a run reports to, and what they call it."""

    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str | None = (
        None  # None: the tracker's own variable (WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME) when set, else "polo"
    )
    run_name: str | None = None  # None: the output directory's name
    config: dict | None = None  # the run's configuration, recorded by the trackers that keep one
    store_dir: str | None = None  # where wandb/, mlflow.db and mlruns/ go; None: the output directory

    @classmethod
    def of(cls, config: Any) -> Trackers:
        """Return the trackers of a run configuration (its output's report_to, project, run_name, tracker_dir)."""
        output = config.output
        return cls(
            list(output.report_to), output.project, output.run_name, dataclasses.asdict(config), output.tracker_dir
        )

    def store(self, output_dir: Path) -> Path:
        """Return the directory of the trackers' local stores for a run writing to `output_dir`."""
        return Path(self.store_dir) if self.store_dir else Path(output_dir)

    def project_name(self, variable: str | None = None) -> str:
        return self.project or (os.environ.get(variable) if variable else None) or "polo"

    def name(self, output_dir: Path) -> str:
        return self.run_name or Path(output_dir).resolve().name


def flatten(mapping: dict, prefix: str = "") -> dict[str, Any]:
    """Return nested dicts as one level of `dotted.key: value`."""
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def mlflow_key(key: str) -> str:
    """Return `key` with the characters mlflow refuses in metric and param names replaced by "_"."""
    return re.sub(r"[^/\w.\- :]", "_", key)


class TensorBoardSink:
    """Scalars to `<output.dir>/tensorboard/` (no tables)."""

    tables = False

    def __init__(self, output_dir: Path, start_step: int, trackers: Trackers):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=start_step + 1)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases, offline under `<output.dir>/wandb/` unless WANDB_MODE says otherwise; tables as
    `wandb.Table`."""

    tables = True

    def __init__(self, output_dir: Path, start_step: int, trackers: Trackers):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=trackers.project_name("WANDB_PROJECT"),
            name=trackers.name(output_dir),
            config=trackers.config,
            dir=os.environ.get("WANDB_DIR") or str(trackers.store(output_dir)),
            mode=os.environ.get("WANDB_MODE") or "offline",
            reinit="create_new",  # a run of its own, whatever other wandb run the process holds
        )
        self.where = f"wandb run {self.run.name} in {self.run.dir.removesuffix('/files')}"

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """MLflow: a local sqlite store in the output directory unless MLFLOW_TRACKING_URI is set.

    Tables go through `log_table`, one JSON artifact per `TABLE_STEPS` steps
    (`completions/steps_000001-000100.json`, with a step column): mlflow appends a table to an
    existing file by rewriting it, and lists every table file in one size-limited run tag.
    """

    tables = True
    TABLE_STEPS = 100

    def __init__(self, output_dir: Path, start_step: int, trackers: Trackers):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        store = trackers.store(output_dir)
        store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(uri or f"sqlite:///{(store / 'mlflow.db').resolve()}")
        name = trackers.project_name("MLFLOW_EXPERIMENT_NAME")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = None if uri else (store / "mlruns").resolve().as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=trackers.name(output_dir)).info.run_id
        if trackers.config:
            params = [Param(mlflow_key(key), str(value)[:6000]) for key, value in flatten(trackers.config).items()]
            self.client.log_batch(self.run_id, params=params)
        where = "MLFLOW_TRACKING_URI" if uri else self.client.tracking_uri  # a server's address may hold a password
        self.where = f"mlflow run {trackers.name(output_dir)} ({self.run_id}) in experiment {name} of {where}"

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(mlflow_key(key), float(value), now, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        first = (max(step, 1) - 1) // self.TABLE_STEPS * self.TABLE_STEPS + 1
        data = {column: [row[index] for row in rows] for index, column in enumerate(columns)}
        quiet = (
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
        )  # appending re-reads the file, with a progress bar
        if quiet:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
        try:
            self.client.log_table(
                self.run_id, data, f"{name}/steps_{first:06d}-{first + self.TABLE_STEPS - 1:06d}.json"
            )
        finally:
            if quiet:
                os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioSink:
    """Trackio, in its local database (TRACKIO_DIR); tables as `trackio.Table`."""

    tables = True

    def __init__(self, output_dir: Path, start_step: int, trackers: Trackers):
        import trackio

        self.trackio = trackio
        project = trackers.project_name()
        self.run = trackio.init(project=project, name=trackers.name(output_dir), config=trackers.config)
        self.where = f"trackio run {self.run.name} in project {project} (trackio show --project {project})"

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()
        current = getattr(getattr(self.trackio, "context_vars", None), "current_run", None)
        if current is not None and current.get() is self.run:
            current.set(None)  # what trackio.finish() does for the run it holds


# Every name `output.report_to` accepts; "jsonl" (metrics.jsonl) is always written and needs no sink.
SINKS: dict[str, type | None] = {
    "tensorboard": TensorBoardSink,
    "jsonl": None,
    "wandb": WandbSink,
    "trackio": TrackioSink,
    "mlflow": MlflowSink,
}


def logs_tables(report_to: list[str]) -> bool:
    """Return True when a tracker in `report_to` keeps tables (only then is a step's completions table built)."""
    return any(getattr(SINKS.get(name), "tables", False) for name in report_to)


def open_sinks(names: list[str], output_dir: Path, start_step: int, trackers: Trackers) -> list[Sink]:
    """Return a started sink for each tracker in `names` (duplicates and "jsonl" add none)."""
    sinks: list[Sink] = []
    try:
        for name in dict.fromkeys(names):
            if name not in SINKS:
                raise ValueError(f"output.report_to: {name!r} is not one of {', '.join(SINKS)}")
            if SINKS[name] is not None:
                sinks.append(SINKS[name](output_dir, start_step, trackers))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
