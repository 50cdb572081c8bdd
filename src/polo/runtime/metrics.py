"""Run logging: one metrics row per step to JSONL and the trackers (TensorBoard, wandb, ...), and the run's progress:
a bar on a terminal, one line a step anywhere else (a log file, a pipe, a scheduler's output)."""

from __future__ import annotations

import atexit
import json
import math
import sys
import time
from pathlib import Path

from polo.runtime.parallel import is_main_process
from polo.runtime.trackers import Sink, Trackers, open_sinks


def read_metrics(path: Path) -> list[dict]:
    """Return the rows of a metrics.jsonl file (empty when it does not exist)."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break  # a process killed mid-write leaves a partial last line: that row was never logged
            raise ValueError(f"{path}:{number} is not valid JSON") from None
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after `last_step` (a resumed run re-does those steps)."""
    if not path.exists():
        return
    kept = [row for row in read_metrics(path) if row.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(row) + "\n" for row in kept))


def on_terminal() -> bool:
    """Return whether stderr, where progress goes, is a terminal: a bar redraws there, and nowhere else."""
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def quiet_library_bars() -> None:
    """Turn off the progress bars of transformers and the Hub ("Loading weights", "Writing model shards"): in a log
    file each is a line of carriage returns, at every load and every checkpoint. Called where output is no terminal."""
    try:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging

        logging.disable_progress_bar()
        disable_progress_bars()
    except ImportError:  # neither is needed to log a run
        pass


def progress_line(step: int, total: int, summary: dict) -> str:
    """Return the one line a step prints where there is no bar, e.g. "polo: step 3/40 reward=0.25 accuracy=0.5"."""
    fields = " ".join(
        f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}" for key, value in summary.items()
    )
    return f"polo: step {step}/{total} {fields}".rstrip()


class MetricsLogger:
    """Writes metrics rows to `<dir>/metrics.jsonl` and the run's trackers, and drives the progress bar.

    `trackers.report_to` names the trackers (`polo.runtime.trackers`); without `trackers` it is
    TensorBoard alone.
    """

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        trackers: Trackers | None = None,
    ):
        self.main = is_main_process()
        self.path = output_dir / "metrics.jsonl"
        self.sinks: list[Sink] = []
        self.bar, self.lines, self.total_steps = None, False, total_steps
        if not self.main:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        trackers = trackers or Trackers()
        self.sinks = open_sinks(trackers.report_to, output_dir, start_step, trackers)
        for sink in self.sinks:
            if getattr(sink, "where", None):
                print(f"polo: reporting to {sink.where}", flush=True)
        if any(getattr(sink, "where", None) for sink in self.sinks):
            atexit.register(self.close)  # a run that stops on an error still finishes its tracker runs
        self.lines = progress and not on_terminal()
        if not on_terminal():
            quiet_library_bars()
        if progress and not self.lines:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="polo", unit="step", dynamic_ncols=True)

    @property
    def logs_tables(self) -> bool:
        """Whether a tracker here keeps tables (`log_completions` does nothing otherwise)."""
        return any(sink.tables for sink in self.sinks)

    def log(self, row: dict) -> None:
        """Append one row (must hold "step") to metrics.jsonl, and its numbers to every tracker."""
        if not self.main:
            return
        row = {**row, "timestamp": row.get("timestamp", time.time())}
        clean = {
            key: (None if isinstance(value, float) and not math.isfinite(value) else value)
            for key, value in row.items()
        }
        with self.path.open("a") as handle:
            handle.write(json.dumps(clean) + "\n")
        scalars = {
            key: value
            for key, value in row.items()
            if key not in ("step", "timestamp") and isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        for sink in self.sinks:
            sink.log_scalars(row["step"], scalars)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """Log the step's completions (one dict per completion, same keys) as a `completions` table, with a step column.

        A tracker that fails to take a table is warned about once and gets no more tables; the run goes on.
        """
        if not self.main or not rows or not self.logs_tables:
            return
        columns = ["step", *rows[0]]
        data = [[step, *(row.get(column) for column in columns[1:])] for row in rows]
        for sink in self.sinks:
            if not sink.tables:
                continue
            try:
                sink.log_table(step, "completions", columns, data)
            except Exception as error:
                sink.tables = False
                self.write(
                    f"polo: warning: {type(sink).__name__} could not log the completions table, no more tables go "
                    f"to it: {error}"
                )

    def log_samples(self, rows: list[dict]) -> None:
        """Append sample completions (each row holds "step") to `<dir>/samples.jsonl`, for reports."""
        if not self.main or not rows:
            return
        with (self.path.parent / "samples.jsonl").open("a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)

    def advance(self, step: int, summary: dict) -> None:
        """Move the progress bar to `step` and show the summary fields (step, reward, ...); without a terminal, print
        them as one line on stderr instead."""
        if self.main and self.lines:
            print(progress_line(step, self.total_steps, summary), file=sys.stderr, flush=True)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(
                {key: f"{value:.3g}" if isinstance(value, float) else value for key, value in summary.items()},
                refresh=True,
            )

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Close the progress bar and finish every tracker run (once; later calls do nothing)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
        atexit.unregister(self.close)
