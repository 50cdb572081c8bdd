"""Ctrl-C as a request: finish the current step, checkpoint, then stop (a second Ctrl-C aborts at once)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


class StopRequest:
    """Turns the first Ctrl-C into a request to stop after the current step (and checkpoint).

    A second Ctrl-C interrupts at once. Outside the main thread signals cannot be caught and
    Ctrl-C behaves as usual.
    """

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.requested = False
        self.previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say("polo: stopping after this step and saving a checkpoint (Ctrl-C again to abort now)")

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
