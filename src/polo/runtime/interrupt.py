"""Stop signals as requests: finish the current step, checkpoint, then stop (a second signal aborts at once).

Ctrl-C (SIGINT), a scheduler's SIGTERM (SLURM, Kubernetes, torchrun's agent) and SIGHUP (a closed
terminal) are all handled alike: the first asks the run to stop after the step in progress, which
it saves; the run then raises `RunStopped`, which the command line reports in one line with the
command that continues the run, exiting with `EXIT_STOPPED` (75, EX_TEMPFAIL: "try again") after
SIGTERM or SIGHUP and 130 after Ctrl-C. A second signal raises `StopNow` at once.

`StopRequest`s nest (the pipeline holds one around its stages, each stage's loop its own): they
share one record of the signal received, which the outermost clears when it is entered.

Work that is worth nothing half done and leaves nothing to save (a held-out evaluation before the
first step, or after the last one was saved) runs inside `StopRequest.abandoning()`: there the
first signal stops it at once with `Abandoned`, instead of waiting minutes for it to finish.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

EXIT_STOPPED = 75  # EX_TEMPFAIL from sysexits.h: the run stopped cleanly and can be continued
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


@dataclass
class _Received:
    """The stop signal this process received inside the outermost `StopRequest` (None: none yet), and the nesting
    depth."""

    signum: int | None = None
    depth: int = 0
    abandoning: str | None = None  # inside `StopRequest.abandoning`: what the first signal's message says


_RECEIVED = _Received()


def signal_name(signum: int) -> str:
    """Return a signal's name, e.g. "SIGTERM"."""
    return signal.Signals(signum).name


def print_now(line: str) -> None:
    """Print `line` at once (returns nothing): a stop message must show while the step in progress runs."""
    print(line, flush=True)


class StopNow(KeyboardInterrupt):
    """A second stop signal: the step in progress was abandoned unsaved; the last checkpoint is intact."""

    def __init__(self, signum: int):
        super().__init__(
            f"a second {signal_name(signum)}: stopped at once; the step in progress is not saved, the last "
            "checkpoint is intact"
        )
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """Return the status of a process killed by this signal (128 + its number; 130 for Ctrl-C)."""
        return 128 + self.signum


class Abandoned(KeyboardInterrupt):
    """The first stop signal, inside `StopRequest.abandoning()`: the work in progress was dropped."""

    def __init__(self, signum: int):
        super().__init__(f"{signal_name(signum)}: the work in progress was abandoned")
        self.signum = signum


class RunStopped(KeyboardInterrupt):
    """A run stopped at a stop signal after its step `step`; `checkpoint` (None: none was written) holds it.

    `step` is None for a pipeline stopped between stages (`where` is then the finished stage).
    A `KeyboardInterrupt`, so a notebook caller sees it as the Ctrl-C it often is. `resumable` is
    False for runs that cannot continue from a checkpoint (`polo control`); `where` names
    the pipeline stage it stopped in, when it did.
    """

    def __init__(self, signum: int, step: int | None, checkpoint: Path | None, resumable: bool = True, where: str = ""):
        self.signum, self.step, self.checkpoint, self.resumable, self.where = signum, step, checkpoint, resumable, where
        super().__init__(self.describe())

    def describe(self) -> str:
        """Return what happened, e.g. "stopped by SIGTERM after step 3; saved runs/x/checkpoints/step-000003"."""
        if self.step is None:  # between two pipeline stages
            return f"stopped by {signal_name(self.signum)} after stage {self.where} finished"
        where = f" in stage {self.where}" if self.where else ""
        when = f"after step {self.step}" if self.step else "before the first step"
        saved = f"; saved {self.checkpoint}" if self.checkpoint is not None else ""
        return f"stopped by {signal_name(self.signum)}{where} {when}{saved}"

    def in_stage(self, label: str) -> RunStopped:
        """Return the same stop, said to have happened in pipeline stage `label`."""
        return RunStopped(self.signum, self.step, self.checkpoint, self.resumable, label)

    @property
    def exit_status(self) -> int:
        """Return the command's exit status: 130 after Ctrl-C, `EXIT_STOPPED` after SIGTERM or SIGHUP."""
        return 130 if self.signum == signal.SIGINT else EXIT_STOPPED


class StopRequest:
    """Turns the first stop signal (SIGINT, SIGTERM, SIGHUP) into a request to stop after the current step (and
    checkpoint).

    A second one raises `StopNow` at once. Outside the main thread signals cannot be caught and
    they act as usual; SIGHUP stays ignored in a process started ignoring it (nohup).
    """

    def __init__(
        self, say: Callable[[str], None] | None = None, plan: str = "stopping after this step and saving a checkpoint"
    ):
        self.say = say or print_now
        self.plan = plan  # what the first signal's message says will happen
        self.previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """Return True once a stop signal arrived."""
        return _RECEIVED.signum is not None

    @property
    def signum(self) -> int:
        """Return the stop signal that arrived (SIGINT when none did: the caller stops for its own reason)."""
        return _RECEIVED.signum if _RECEIVED.signum is not None else signal.SIGINT

    def _handle(self, signum, frame) -> None:
        if _RECEIVED.signum is not None:
            raise StopNow(signum)
        _RECEIVED.signum = signum
        if _RECEIVED.abandoning is not None:
            self.say(f"polo: {signal_name(signum)}: {_RECEIVED.abandoning}")
            raise Abandoned(signum)
        again = "Ctrl-C" if signum == signal.SIGINT else f"send {signal_name(signum)}"
        self.say(f"polo: {signal_name(signum)}: {self.plan} ({again} again to abort now)")

    @contextmanager
    def abandoning(self, plan: str) -> Iterator[None]:
        """Within, the first stop signal raises `Abandoned` at once (a signal already received, on entry); `plan`
        is what its message says happens next."""
        if _RECEIVED.signum is not None:
            raise Abandoned(_RECEIVED.signum)
        previous, _RECEIVED.abandoning = _RECEIVED.abandoning, plan
        try:
            yield
        finally:
            _RECEIVED.abandoning = previous

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        if _RECEIVED.depth == 0:
            _RECEIVED.signum = None
        _RECEIVED.depth += 1
        for signum in STOP_SIGNALS:
            if (
                signum != getattr(signal, "SIGHUP", None) or signal.getsignal(signum) is not signal.SIG_IGN
            ):  # nohup stays nohup
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        self.previous = {}
        _RECEIVED.depth -= 1
