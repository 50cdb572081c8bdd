"""Writing model directories whole or not at all.

A checkpoint or a final model is written into a hidden staging directory next to its target and
renamed into place only once every file is there, so a crash never leaves half a model where a
loader (or `polo train`'s resume) would find it. When the write fails (a full disk, a missing
permission) the staging directory is removed and the error says what was being written, why it
failed, how much space is left, and that what was there before is untouched.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class SaveError(OSError):
    """A model or checkpoint directory could not be written; nothing already saved was touched."""


def _free_space(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return "unknown"
    return f"{free / 2**20:,.0f} MiB"


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
    except (OSError, RuntimeError) as exc:
        # torch.save reports a full disk as a RuntimeError from its zip writer.
        if isinstance(exc, RuntimeError) and "writ" not in str(exc).lower():
            raise
        shutil.rmtree(staging, ignore_errors=True)
        kept = f"; {keeps}" if keeps else ""
        raise SaveError(
            f"could not write {what} to {target}: {type(exc).__name__}: {exc} "
            f"(free space there: {_free_space(target)}){kept}"
        ) from exc
