"""Run logging: one metrics row per step to JSONL and TensorBoard, and a progress bar."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from polo.runtime.distributed import is_main_process



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


class MetricsLogger:
    """Writes metrics rows to `<dir>/metrics.jsonl` and TensorBoard, and drives the progress bar."""

    def __init__(self, output_dir: Path, total_steps: int, start_step: int = 0, tensorboard: bool = True, progress: bool = True):
        self.main = is_main_process()
        self.path = output_dir / "metrics.jsonl"
        self.writer = None
        self.bar = None
        if not self.main:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=start_step + 1)
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="polo", unit="step", dynamic_ncols=True)

    def log(self, row: dict) -> None:
        """Append one row (must hold "step") to every sink."""
        if not self.main:
            return
        row = {**row, "timestamp": row.get("timestamp", time.time())}
        clean = {key: (None if isinstance(value, float) and not math.isfinite(value) else value) for key, value in row.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(clean) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key not in ("step", "timestamp") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, row["step"])
            self.writer.flush()

    def log_samples(self, rows: list[dict]) -> None:
        """Append sample completions (each row holds "step") to `<dir>/samples.jsonl`, for reports."""
        if not self.main or not rows:
            return
        with (self.path.parent / "samples.jsonl").open("a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)

    def advance(self, step: int, summary: dict) -> None:
        """Move the progress bar to `step` and show the summary fields (step, reward, ...)."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({key: f"{value:.3g}" if isinstance(value, float) else value for key, value in summary.items()}, refresh=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
