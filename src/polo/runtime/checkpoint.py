"""Writing model directories whole or not at all, and reading checkpoints back onto any device.

A checkpoint or a final model is written into a hidden staging directory next to its target and
renamed into place only once every file is there, so a crash never leaves half a model where a
loader (or `polo train`'s resume) would find it. When the write fails (a full disk, a missing
permission) the staging directory is removed and the error says what was being written, why it
failed, how much space is left, and that what was there before is untouched.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from polo.config import ConfigError
from polo.runtime import parallel
from polo.runtime.parallel import is_main_process
from polo.runtime.seeding import rng_state


class SaveError(OSError):
    """A model or checkpoint directory could not be written; nothing already saved was touched."""


class OutputDirInUseError(ConfigError):
    """A fresh run was pointed at a directory that holds an earlier run; nothing there was touched."""


def _free_space(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return "unknown"
    return f"{free / 2**20:,.0f} MiB"


# How writers other than Python's own report a failed write (a full disk, a quota): torch.save's zip
# writer raises RuntimeError ("PytorchStreamWriter failed writing file ...", or an "[enforce fail at
# inline_container.cc:...]" check when the disk filled between two records), safetensors its
# SafetensorError ("IoError(Os { code: 28, kind: StorageFull ... })").
WRITE_FAILURE_MARKS = ("writ", "inline_container", "streamwriter", "no space", "storagefull", "ioerror", "quota")


def is_write_failure(exc: Exception) -> bool:
    """Return whether `exc`, raised while saving files, says that writing them failed (not a bug in the caller)."""
    message = str(exc).lower()
    return isinstance(exc, OSError) or any(mark in message for mark in WRITE_FAILURE_MARKS)


@contextmanager
def staged_directory(target: Path, what: str, keeps: str = "") -> Iterator[Path]:
    """Yield an empty staging directory; on success it replaces `target`, on failure it is removed.

    `what` names the thing being written in the error ("checkpoint step 40"); `keeps` says what
    is still intact ("the last complete checkpoint is .../step-000030").
    """
    target = Path(target)
    staging = target.parent / f".incomplete-{target.name}"
    try:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        yield staging
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if not is_write_failure(exc):
            raise
        kept = f"; {keeps}" if keeps else ""
        raise SaveError(
            f"could not write {what} to {target}: {type(exc).__name__}: {exc} "
            f"(free space there: {_free_space(target)}){kept}"
        ) from exc


class Checkpointer:
    """Saves and finds checkpoint directories `<dir>/checkpoints/step-NNNNNN`.

    `recipe` (the run's config as YAML text) is written into each checkpoint as config.yaml and
    `command` ("polo sft") into its trainer state: a resume compares the recipe and command it is
    given with those the checkpoint was trained under (`polo.runtime.resume`).
    """

    def __init__(self, output_dir: Path, keep: int, recipe: str | None = None, command: str | None = None):
        self.root = output_dir / "checkpoints"
        self.keep = keep
        self.recipe = recipe
        self.command = command

    def latest(self) -> Path | None:
        complete = [path for path in self.root.glob("step-*") if (path / "trainer_state.pt").exists()]
        return max(complete, key=lambda path: int(path.name.split("-")[1]), default=None)

    def save(self, step: int, model, tokenizer, optimizer, scheduler, extra: dict, masters=None) -> Path | None:
        """Write checkpoint `step` from rank 0 (with every rank's RNG state) and return its path (None on other ranks).

        Every rank must call it: the RNG states are gathered, and no rank goes on before the
        checkpoint is whole. With `masters` (bf16_master) the fp32 master weights are saved.
        """
        rng_per_rank = parallel.gather_objects(rng_state())
        model_state, optimizer_state = parallel.full_state_dicts(model, optimizer)  # gathered whole under FSDP
        if masters is not None:
            model_state = masters.state_dict(model)
        target = None
        if is_main_process():
            extra = {**extra, "rng_per_rank": rng_per_rank}
            target = self._write(
                step, model, model_state, tokenizer, optimizer_state, scheduler, extra, fp32_masters=masters is not None
            )
        parallel.barrier()
        return target

    def _write(
        self,
        step: int,
        model,
        model_state: dict | None,
        tokenizer,
        optimizer_state: dict,
        scheduler,
        extra: dict,
        fp32_masters: bool = False,
    ) -> Path:
        target = self.root / f"step-{step:06d}"
        previous = self.latest()
        keeps = f"the last complete checkpoint {previous} is intact" if previous else "no checkpoint was written yet"
        with staged_directory(target, f"checkpoint step {step}", keeps) as staging:
            model.save_pretrained(str(staging), safe_serialization=True, state_dict=model_state)
            if (
                fp32_masters and (staging / "config.json").exists()
            ):  # transformers writes the in-memory (bf16) dtype; the saved weights are the fp32 masters
                mark_float32(staging / "config.json")
            tokenizer.save_pretrained(str(staging))
            if self.recipe is not None:
                (staging / "config.yaml").write_text(self.recipe)
            state = {
                "step": step,
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
                "command": self.command,
                **extra,
            }
            torch.save(state, staging / "trainer_state.pt")  # last: a checkpoint is whole once this exists
        self._rotate(target)
        return target

    def _rotate(self, newest: Path) -> None:
        """Remove all but the `keep` newest checkpoints; `newest` (maybe the final model) stays whatever `keep` says."""
        checkpoints = sorted(self.root.glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
        # keep < 1 is refused by validation; this is the second line of defence, for callers that skip it.
        for old in checkpoints[: max(len(checkpoints) - max(self.keep, 1), 0)]:
            if old != newest:
                shutil.rmtree(old)


def load_trainer_state(checkpoint: Path) -> dict:
    """Return a checkpoint's trainer state (step, optimizer, scheduler, RNG and run state) with every tensor on the CPU.

    A checkpoint is device-free: whatever device wrote it, its tensors load onto the CPU, and
    each consumer places them on this run's device (`Optimizer.load_state_dict` moves a state to
    its parameter's device, `load_state_dict` copies into the module's own tensors, RNG states
    are CPU tensors). So a GPU run resumes on a CPU machine and the other way round.
    """
    return torch.load(Path(checkpoint) / "trainer_state.pt", map_location="cpu", weights_only=False)


def mark_float32(config_path: Path) -> None:
    """Set `dtype` to float32 in a saved model's config.json (its weights are the fp32 masters, not the bf16 working
    copy)."""
    config = json.loads(Path(config_path).read_text())
    config["dtype"] = "float32"
    Path(config_path).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# What polo writes into an output directory; anything else there is the user's and is never touched.
RUN_FILES = (
    "checkpoints",
    "final",
    "tensorboard",
    "metrics.jsonl",
    "samples.jsonl",
    "config.yaml",
    "config_changes.jsonl",
    "summary.json",
    "reward.png",
    "accuracy.png",
    "length.png",
    "r1.png",
    "report.html",
    "wandb",
    "mlflow.db",
    "mlruns",
)


def previous_run(output_dir: Path) -> list[Path]:
    """Return the files and folders of an earlier run in `output_dir` (empty when there is none)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [output_dir / name for name in RUN_FILES if (output_dir / name).exists()]
    return found + sorted(output_dir.glob("eval_step*.json"))


def finished_a_step(output_dir: Path) -> bool:
    """Return True when the run in `output_dir` finished at least one step: a checkpoint, a final model, a summary, or
    a metrics row past step 0.

    A run that failed before its first step (a bad reward, a model that did not fit) leaves
    config.yaml, tensorboard/ and maybe a step-0 evaluation: nothing a rerun would lose.
    """
    output_dir = Path(output_dir)
    if any(output_dir.glob("checkpoints/*step-*")) or (output_dir / "final").exists():
        return True
    if (output_dir / "summary.json").exists():
        return True
    metrics = output_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    with open(metrics) as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except ValueError:  # a partial last line, or not polo's: either way no finished step
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int | float) and row["step"] >= 1:
                return True
    return False


def claim_output_dir(output_dir: Path, overwrite: bool, resume: bool | None = None) -> None:
    """Refuse to start a fresh run over an earlier run's files unless `overwrite`, which removes them first.

    Call it only when the run does not continue from a checkpoint. `resume` is None for commands
    that cannot resume (polo control), else the run's `output.resume` (True here means it was
    asked for but there is no checkpoint to continue from). The files of a run that never finished
    a step are no run to protect: they are replaced, with a line that says so. Every rank may call
    it: all refuse alike, and only the main process removes anything.
    """
    found = previous_run(output_dir)
    if not found:
        return
    names = ", ".join(path.name + ("/" if path.is_dir() else "") for path in found[:4]) + (
        ", ..." if len(found) > 4 else ""
    )
    finished = finished_a_step(output_dir)
    if not overwrite and finished:
        if resume:
            raise OutputDirInUseError(
                f"output.resume=true but output.dir {output_dir} has no complete checkpoint, only an earlier run's "
                f"files ({names}): replace them with output.overwrite=true, or pick a new output.dir"
            )
        resumable = resume is not None and any(Path(output_dir).glob("checkpoints/step-*/trainer_state.pt"))
        resume_way = "continue it with output.resume=true, or " if resumable else ""
        raise OutputDirInUseError(
            f"output.dir {output_dir} already holds a run ({names}): {resume_way}replace it with "
            "output.overwrite=true, or pick a new output.dir"
        )
    if is_main_process():
        for path in found:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if not finished:
            print(f"polo: output.dir {output_dir} held only a run that never finished a step ({names}): replaced")
        else:
            print(f"polo: output.overwrite=true: removed the earlier run in {output_dir} ({names})")
