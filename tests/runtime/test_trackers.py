"""Experiment trackers (`output.report_to`): each sink runs for real against its local store, and what
it stored is read back; a tiny training run reports to wandb, mlflow and trackio at once.

Nothing may leave the machine: wandb runs offline, mlflow writes a sqlite file, trackio its local
database, and a connection to anything but this host fails the test.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from polo.config import ConfigError, load_config
from polo.runtime.metrics import MetricsLogger, read_metrics
from polo.runtime.trackers import SINKS, Trackers, logs_tables, mlflow_key

sys.path.insert(0, str(Path(__file__).parents[1] / "rl"))
from test_trainer import tiny_config

POLO = Path(sys.executable).with_name("polo")
TRACKER_VARIABLES = (
    "WANDB_MODE",
    "WANDB_DIR",
    "WANDB_PROJECT",
    "WANDB_RUN_ID",
    "WANDB_RESUME",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "TRACKIO_SPACE_ID",
    "TRACKIO_SERVER_URL",
    "TRACKIO_DATASET_ID",
    "TRACKIO_BUCKET_ID",
)
ROWS = [  # three steps of a run: the second with a non-finite number, as a diverging step logs it
    {"step": 1, "reward/mean": 0.25, "accuracy": 0.5, "loss": 1.5, "learning_rate": 1e-3},
    {"step": 2, "reward/mean": 0.5, "accuracy": 0.75, "loss": float("nan"), "learning_rate": 1e-3},
    {"step": 3, "reward/mean": 0.75, "accuracy": 1.0, "loss": 0.5, "learning_rate": 5e-4},
]
COMPLETIONS = [
    {"prompt": "What is 2 + 3?", "completion": "5", "reward": 1.5, "reward/correct": 1.0, "advantage": 0.7},
    {"prompt": "What is 2 + 3?", "completion": "six", "reward": 0.0, "reward/correct": 0.0, "advantage": -0.7},
]


@pytest.fixture(scope="module", autouse=True)
def trackio_dir(tmp_path_factory) -> Path:
    """Point trackio at a scratch directory: it reads TRACKIO_DIR once, when first imported."""
    if "trackio" in sys.modules:
        from trackio.utils import TRACKIO_DIR

        return TRACKIO_DIR
    directory = tmp_path_factory.mktemp("trackio")
    os.environ["TRACKIO_DIR"] = str(directory)
    return directory


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Clear the user's tracker settings and fail any connection that leaves this host."""
    for variable in TRACKER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    attempts, connect = [], socket.socket.connect

    def local_only(sock, address):
        if sock.family == socket.AF_UNIX or (
            isinstance(address, tuple) and address[0] in ("127.0.0.1", "localhost", "::1")
        ):
            return connect(sock, address)
        attempts.append(address)
        raise OSError(f"test: no network ({address})")

    monkeypatch.setattr(socket.socket, "connect", local_only)
    yield
    assert not attempts, f"a tracker tried the network: {attempts}"


def log_run(
    output_dir: Path, report_to: list[str], project: str, completions_at=(1, 2), run_name: str | None = "tiny"
) -> None:
    trackers = Trackers(report_to, project, run_name, {"train": {"steps": 3}})
    logger = MetricsLogger(output_dir, 3, progress=False, trackers=trackers)
    for row in ROWS:
        logger.log(row)
        if row["step"] in completions_at:
            logger.log_completions(row["step"], COMPLETIONS)
    for step in completions_at:
        if step > ROWS[-1]["step"]:
            logger.log_completions(step, COMPLETIONS)
    logger.close()


def same(a, b) -> bool:
    return (a is None or math.isnan(a)) if b is None or math.isnan(b) else math.isclose(a, b, rel_tol=1e-6)


def same_rows(got: list[list], expected: list[list]) -> bool:
    return len(got) == len(expected) and all(
        len(g) == len(e) and all(same(x, y) if isinstance(y, float) else x == y for x, y in zip(g, e))
        for g, e in zip(got, expected)
    )


def table(step: int) -> list[list]:
    return [[step, *row.values()] for row in COMPLETIONS]


# ---- wandb: history from the offline run's .wandb file (a LevelDB-style log of protobuf records) ----


def wandb_records(path: Path):
    """Yield the `Record`s of a `.wandb` file: a 7-byte header, then 32 KiB blocks of (crc, length, type) chunks."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, block = path.read_bytes(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # too little room left for a chunk header: the block is padded
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:  # zero padding to the end of the block
            position += block - position % block
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def has_exit_record(path: Path) -> bool:
    try:
        return any(record.WhichOneof("record_type") == "exit" for record in wandb_records(path))
    except Exception:
        return False


def wandb_run(output_dir: Path) -> tuple[Path, list[dict]]:
    """Return (the only offline run's directory, its history rows: step -> merged values)."""
    (run_dir,) = (output_dir / "wandb").glob("offline-run-*")
    path = next(run_dir.glob("run-*.wandb"))
    # run.finish() returns once wandb-core has the exit record; it writes the file out a moment later.
    deadline = time.monotonic() + 60
    while not has_exit_record(path):
        assert time.monotonic() < deadline, f"{path} never got its exit record"
        time.sleep(0.1)
    by_step: dict[int, dict] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            by_step.setdefault(row["_step"], {}).update(row)
    return run_dir, [by_step[step] for step in sorted(by_step)]


def wandb_table(run_dir: Path, row: dict, name: str = "completions") -> tuple[list, list]:
    stored = json.loads((run_dir / "files" / row[f"{name}/path"]).read_text())
    return stored["columns"], stored["data"]


def test_wandb_runs_offline_in_the_output_dir_and_keeps_scalars_and_tables(tmp_path):
    log_run(tmp_path, ["wandb"], "polo-test")
    run_dir, history = wandb_run(tmp_path)
    assert [row["_step"] for row in history] == [1, 2, 3]
    for row, logged in zip(ROWS, history):
        assert all(same(logged.get(key), value) for key, value in row.items() if key != "step"), (row, logged)
    for step in (1, 2):
        columns, data = wandb_table(run_dir, history[step - 1])
        assert columns == ["step", *COMPLETIONS[0]] and data == table(step)
    assert "completions/path" not in history[2]  # no table at step 3
    run = next(
        record.run
        for record in wandb_records(next(run_dir.glob("run-*.wandb")))
        if record.WhichOneof("record_type") == "run"
    )
    assert (run.project, run.display_name) == ("polo-test", "tiny")


# ---- mlflow: MlflowClient on the sqlite store, the tables as JSON artifacts ----


def mlflow_run(output_dir: Path, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{output_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def mlflow_table(client, run, path: str) -> tuple[list, list]:
    stored = json.loads(Path(client.download_artifacts(run.info.run_id, path)).read_text())
    return stored["columns"], stored["data"]


def test_mlflow_writes_a_sqlite_store_in_the_output_dir_and_keeps_scalars_and_tables(tmp_path):
    output_dir = tmp_path / "mlflow-run"
    log_run(
        output_dir, ["mlflow"], "polo-test", completions_at=(1, 2, 3, 101), run_name=None
    )  # 101: a second table file

    client, run = mlflow_run(output_dir, "polo-test")
    assert run.info.run_name == "mlflow-run" and run.info.status == "FINISHED"  # named after the output directory
    for key in ("reward/mean", "accuracy", "loss", "learning_rate"):
        history = sorted((metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, key))
        assert [step for step, _ in history] == [1, 2, 3]
        assert all(same(value, row[key]) for (_, value), row in zip(history, ROWS))
    assert run.data.params["train.steps"] == "3"
    assert mlflow_table(client, run, "completions/steps_000001-000100.json") == (
        ["step", *COMPLETIONS[0]],
        table(1) + table(2) + table(3),
    )
    assert mlflow_table(client, run, "completions/steps_000101-000200.json")[1] == table(101)
    assert run.info.artifact_uri.startswith((output_dir / "mlruns").as_uri())
    assert (
        mlflow_key("reward/my.rewards:fn <lambda>/mean") == "reward/my.rewards:fn _lambda_/mean"
    )  # what mlflow accepts


# ---- trackio: its local database, read with its own storage class ----


def trackio_logs(project: str, run: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run)


def test_trackio_keeps_scalars_and_tables_in_its_local_database(tmp_path, trackio_dir):
    project = f"polo-test-{uuid.uuid4().hex[:8]}"
    log_run(tmp_path, ["trackio"], project)
    logs = trackio_logs(project, "tiny")
    scalars = [row for row in logs if "reward/mean" in row]
    assert [row["step"] for row in scalars] == [1, 2, 3]
    for row, logged in zip(ROWS, scalars):
        assert all(same(logged.get(key), value) for key, value in row.items() if key != "step"), (row, logged)
    tables = [row for row in logs if "completions" in row]
    assert [row["step"] for row in tables] == [1, 2]
    for row in tables:
        assert row["completions"]["_type"] == "trackio.table"
        assert row["completions"]["_value"] == [
            dict(zip(["step", *COMPLETIONS[0]], values)) for values in table(row["step"])
        ]
    assert any(Path(trackio_dir).glob(f"{project}.*"))  # in TRACKIO_DIR, not the user's home


# ---- the logger, the configuration and the command line ----


def test_tensorboard_is_the_default_and_an_empty_report_to_removes_it(tmp_path):
    config = load_config({"output": {"dir": str(tmp_path / "a")}})
    assert config.output.report_to == ["tensorboard"] and not logs_tables(config.output.report_to)
    MetricsLogger(tmp_path / "a", 1, progress=False, trackers=Trackers.of(config)).close()
    assert (tmp_path / "a" / "tensorboard").is_dir()
    config = load_config({"output": {"dir": str(tmp_path / "b"), "report_to": []}})
    logger = MetricsLogger(tmp_path / "b", 1, 0, progress=False, trackers=Trackers.of(config))
    logger.log({"step": 1, "reward/mean": 1.0})
    logger.close()
    assert logger.sinks == [] and not (tmp_path / "b" / "tensorboard").exists()
    assert read_metrics(tmp_path / "b" / "metrics.jsonl")[0]["reward/mean"] == 1.0  # jsonl is always written
    assert load_config(None, ["output.report_to=wandb"]).output.report_to == ["wandb"]
    assert set(SINKS) == {"tensorboard", "jsonl", "wandb", "trackio", "mlflow"}
    assert logs_tables(["tensorboard", "mlflow"])


def test_the_removed_output_tensorboard_says_what_replaced_it():
    with pytest.raises(ConfigError) as error:
        load_config({"output": {"tensorboard": False}})
    assert str(error.value) == (
        "output.tensorboard was removed; output.report_to replaced it: list the trackers, e.g. "
        "output.report_to=[tensorboard] (the default), or [] for none (metrics.jsonl is always written)"
    )


def test_an_unknown_tracker_is_one_line_naming_the_valid_ones():
    with pytest.raises(ConfigError) as error:
        load_config({"output": {"report_to": ["tensorboard", "neptune"]}})
    assert str(error.value) == "output.report_to: 'neptune' is not one of tensorboard, jsonl, wandb, trackio, mlflow"


@pytest.mark.parametrize(
    ("tracker", "package"), [("wandb", "wandb"), ("trackio", "trackio"), ("mlflow", "mlflow"), ("mlflow", "sqlalchemy")]
)
def test_a_missing_tracker_package_is_one_line_naming_the_extra(monkeypatch, tracker, package):
    monkeypatch.setitem(sys.modules, package, None)  # importlib's find_spec now reports it missing
    with pytest.raises(ConfigError) as error:
        load_config({"output": {"report_to": [tracker]}})
    assert (
        str(error.value) == f"output.report_to includes {tracker} but the {package} package is not installed: "
        f"pip install 'polo[{tracker}]'"
    )
    if package == "sqlalchemy":  # only mlflow's local store needs it
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
        load_config({"output": {"report_to": [tracker]}})


def test_polo_train_stops_on_a_missing_tracker_before_the_model_loads(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps({"model": {"name": str(tmp_path / "no-model-here")}, "output": {"dir": str(tmp_path / "run")}})
    )
    # Prepended: some machines (the GPU one) find installed packages through PYTHONPATH.
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")])),
    }
    result = subprocess.run(
        [str(POLO), "train", str(recipe), "output.report_to=[tensorboard,wandb]"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        "polo: error: output.report_to includes wandb but the wandb package is not installed: pip install 'polo[wandb]'"
    ]


class BrokenTables:
    tables = True

    def __init__(self):
        self.scalars, self.tables_tried = [], 0

    def log_scalars(self, step, scalars):
        self.scalars.append(step)

    def log_table(self, step, name, columns, rows):
        self.tables_tried += 1
        raise RuntimeError("disk full")

    def close(self):
        pass


def test_a_tracker_that_fails_on_a_table_is_warned_about_once_and_the_run_goes_on(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, 3, progress=False, trackers=Trackers([]))
    broken = BrokenTables()
    logger.sinks = [broken]
    for row in ROWS:
        logger.log(row)
        logger.log_completions(row["step"], COMPLETIONS)
    logger.close()
    assert broken.scalars == [1, 2, 3] and broken.tables_tried == 1
    assert capsys.readouterr().out.count("BrokenTables could not log the completions table") == 1


# ---- end to end: a tiny run reports to all three, each store holds what metrics.jsonl holds ----


def test_a_training_run_reports_scalars_and_completions_to_wandb_mlflow_and_trackio(tiny_model_dir, tmp_path):
    from polo.rl.train import train

    project = f"polo-e2e-{uuid.uuid4().hex[:8]}"
    output = {
        "report_to": ["wandb", "mlflow", "trackio"],
        "plots": False,
        "project": project,
        "run_name": "tiny",
    }
    config = tiny_config(
        tiny_model_dir, tmp_path / "run", output=output, train={"steps": 2}, eval={"before": False, "after": True}
    )
    result = train(config)
    rows = {row["step"]: row for row in result.metrics if "reward/mean" in row}
    assert sorted(rows) == [1, 2]
    completions = 2 * 4  # prompts_per_step x group_size, every step

    run_dir, history = wandb_run(result.output_dir)
    wandb_rows = {row["_step"]: row for row in history}
    mlflow_client, mlflow_run_ = mlflow_run(result.output_dir, project)
    mlflow_rewards = {
        metric.step: metric.value for metric in mlflow_client.get_metric_history(mlflow_run_.info.run_id, "reward/mean")
    }
    logs = trackio_logs(project, "tiny")
    trackio_rewards = {row["step"]: row["reward/mean"] for row in logs if "reward/mean" in row}
    for step, row in rows.items():
        assert same(wandb_rows[step]["reward/mean"], row["reward/mean"])
        assert same(mlflow_rewards[step], row["reward/mean"])
        assert same(trackio_rewards[step], row["reward/mean"])
    assert same(wandb_rows[2]["eval/accuracy"], result.eval_after["accuracy"])  # held-out rows go to the trackers too

    _, mlflow_data = mlflow_table(mlflow_client, mlflow_run_, "completions/steps_000001-000100.json")
    trackio_tables = {row["step"]: row["completions"]["_value"] for row in logs if "completions" in row}
    for step, row in rows.items():
        columns, data = wandb_table(run_dir, wandb_rows[step])
        assert columns == ["step", "prompt", "completion", "reward", "reward/correct", "reward/tag_count", "advantage"]
        assert len(data) == completions and all(values[0] == step for values in data)
        as_dicts = [dict(zip(columns, values)) for values in data]
        assert same(sum(entry["reward"] for entry in as_dicts) / completions, row["reward/mean"])
        for entry in as_dicts:  # the total is the weighted sum of the functions (correct 1.0, tag_count 0.5)
            assert same(entry["reward"], entry["reward/correct"] + 0.5 * entry["reward/tag_count"])
        for group in range(2):  # GRPO's advantages are centred within each group
            assert abs(sum(entry["advantage"] for entry in as_dicts[4 * group : 4 * group + 4])) < 1e-4
        assert same_rows([values for values in mlflow_data if values[0] == step], data)  # mlflow's JSON keeps 10 digits
        assert trackio_tables[step] == as_dicts


def test_completion_rows_average_token_level_advantages_and_follow_the_kept_groups(monkeypatch):
    import torch

    from polo.generation.rollouts import Rollouts
    from polo.rl.batching import Batch, align_groups
    from polo.rl.step import completion_rows

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    rollouts = Rollouts(
        torch.ones(4, 2, dtype=torch.long),
        torch.ones(4, 2),
        torch.ones(4, 3, dtype=torch.long),
        mask,
        torch.zeros(4, dtype=torch.bool),
        ["a", "b", "c", "d"],
        group_size=2,
    )
    batch = Batch(
        rollouts, torch.tensor([1.0, 0.0, 0.5, 0.25]), ["p0", "p1"], {"correct": torch.tensor([1.0, 0.0, 1.0, 0.0])}
    )
    advantages = torch.tensor([[1.0, 3.0, 99.0], [0.0, 0.0, 3.0], [-2.0, 99.0, 99.0], [0.0, 1.0, 99.0]])  # 99: padding
    rows = completion_rows(batch, advantages * mask)
    assert [row["advantage"] for row in rows] == [2.0, 1.0, -2.0, 0.5]
    assert [(row["prompt"], row["completion"], row["reward"], row["reward/correct"]) for row in rows] == [
        ("p0", "a", 1.0, 1.0),
        ("p0", "b", 0.0, 0.0),
        ("p1", "c", 0.5, 1.0),
        ("p1", "d", 0.25, 0.0),
    ]
    assert list(rows[0]) == ["prompt", "completion", "reward", "reward/correct", "advantage"]
    assert completion_rows(Batch(rollouts, batch.rewards, batch.prompts), advantages)[0].keys() == {
        "prompt",
        "completion",
        "reward",
        "advantage",
    }
    assert align_groups(batch, 2).columns is batch.columns  # one process: unchanged
    from polo.rl import batching

    monkeypatch.setattr(batching.parallel, "min_over_ranks", lambda groups: 1)  # another rank kept a single group
    cut = align_groups(batch, 2)
    assert [row["reward/correct"] for row in completion_rows(cut, advantages[:2] * mask[:2])] == [1.0, 0.0]


# ---- the other training commands report the same way ----


def demonstrations(path: Path, count: int) -> str:
    rows = [{"prompt": f"What is {i} + 1?", "response": f"{i} + 1 = {i + 1}"} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_polo_sft_reports_to_wandb_and_mlflow(tiny_model_dir, tmp_path, capsys):
    from polo.cli import main

    project, output_dir = f"polo-sft-{uuid.uuid4().hex[:8]}", tmp_path / "sft"
    status = main(
        [
            "sft",
            str(Path(__file__).parents[2] / "recipes" / "rlhf_sft.yaml"),
            "output.report_to=[wandb,mlflow]",
            f"output.project={project}",
            f"output.dir={output_dir}",
            f"model.name={tiny_model_dir}",
            f"data.train_path={demonstrations(tmp_path / 'train.jsonl', 8)}",
            f"data.eval_path={demonstrations(tmp_path / 'eval.jsonl', 4)}",
            "data.max_length=64",
            "train.batch_size=4",
            "train.micro_batch_size=4",
            "train.warmup_steps=0",
            "train.precision=fp32",
            "output.progress=false",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "polo: reporting to wandb run" in out and "polo: reporting to mlflow run sft" in out
    rows = read_metrics(output_dir / "metrics.jsonl")
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    held_out = {row["step"]: row["eval/loss"] for row in rows if "eval/loss" in row}
    assert sorted(losses) == [1, 2] and sorted(held_out) == [0, 2]

    _, history = wandb_run(output_dir)
    wandb_rows = {row["_step"]: row for row in history}
    for step, loss in losses.items():
        assert same(wandb_rows[step]["loss"], loss)
    for step, loss in held_out.items():
        assert same(wandb_rows[step]["eval/loss"], loss)

    client, run = mlflow_run(output_dir, project)
    mlflow_losses = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, "loss")}
    assert mlflow_losses.keys() == losses.keys() and all(same(mlflow_losses[s], losses[s]) for s in losses)
    assert run.info.run_name == "sft" and run.data.params["train.learning_rate"] == "2e-05"
    card = (output_dir / "final" / "README.md").read_text()  # the model card, as polo train writes one
    assert "trained with polo's sft for 2 steps on `train.jsonl`" in card
    assert f"| before training | {held_out[0]:.3f} |" in card and f"| after training | {held_out[2]:.3f} |" in card


def test_a_pipeline_reports_every_stage_to_one_project_in_one_store(tiny_model_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    sys.path.insert(0, str(Path(__file__).parents[1] / "pipeline"))
    from tiny_pipeline import tiny_grpo, tiny_pipeline, tiny_sft

    from polo.pipeline import run_pipeline

    project, root = f"polo-pipeline-{uuid.uuid4().hex[:8]}", tmp_path / "r1"
    recipe = tiny_pipeline(tiny_model_dir, root)
    recipe["stages"] = {"cold_start": tiny_sft(demos={"num_train": 8}), "reason": tiny_grpo(steps=1)}
    for stage in recipe["stages"].values():
        stage["output"].pop("report_to")
    recipe["eval"]["enabled"] = False
    recipe["pipeline"].update({"report_to": ["mlflow"], "project": project, "report": False})
    result = run_pipeline(recipe)

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")  # the pipeline's store, not each stage's
    runs = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    assert sorted(run.info.run_name for run in runs) == ["r1-a_cold_start", "r1-b_reason"]
    for run, stage in zip(sorted(runs, key=lambda run: run.info.run_name), result.stages):
        rows = read_metrics(stage.dir / "metrics.jsonl")
        key = "loss" if stage.kind == "sft" else "reward/mean"
        logged = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, key)}
        assert logged and all(same(logged[row["step"]], row[key]) for row in rows if key in row)
    assert not any((stage.dir / "mlflow.db").exists() for stage in result.stages)
