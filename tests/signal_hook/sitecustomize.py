"""Test-only hooks for polo commands run as subprocesses: prepend this folder to PYTHONPATH and set

- POLO_TEST_SIGTERM=PHASE:N   send this process SIGTERM once, in the middle of PHASE of step N:
                              sampling (its first sampling round), update (the policy update),
                              checkpoint (while writing checkpoint N), fit (the backward
                              pass of optimizer step N of polo sft, rm or dpo);
- POLO_TEST_SIGKILL=PHASE:N   the same with SIGKILL: the process dies there, with no chance to clean up;
- POLO_TEST_HOLD_UNTIL=PATH   once the run has taken its directory's lock, before it checks or writes
                              anything there, wait until PATH exists (at most two minutes).

Python imports `sitecustomize` at start-up; the library itself carries no test hooks.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _signal_once(fired: list, signum: int) -> None:
    """Send this process `signum`, the first time only (a second SIGTERM would abort the run at once)."""
    if not fired:
        fired.append(True)
        os.kill(os.getpid(), signum)


def _signal_before(owner, name: str, fires, signum: int) -> None:
    """Replace `owner.name` with a wrapper that sends `signum` (once) when `fires(args)` is true, then calls the real
    one."""
    real, fired = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        if fires(args):
            _signal_once(fired, signum)
        return real(*args, **kwargs)

    setattr(owner, name, wrapper)


def _install_signal(spec: str, signum: int) -> None:
    """Wrap the polo function of the phase `spec` names so that it sends `signum` in step N."""
    phase, _, number = spec.partition(":")
    target, calls = int(number), []
    if phase == "sampling":  # sample_and_score(run, step, ...)
        from polo.rl import step as module

        _signal_before(module, "sample_and_score", lambda args: args[1] == target, signum)
    elif phase == "update":  # one update per step: the N-th call is step N of this process (counted from its start)
        from polo.rl import step as module

        _signal_before(module, "policy_update", lambda args: calls.append(1) or len(calls) == target, signum)
    elif phase == "fit":  # _backpropagate(trainee, batch, objective, micro_batch_size, name, step)
        from polo.finetune import fit as module

        _signal_before(module, "_backpropagate", lambda args: args[-1] == target, signum)
    elif phase == "checkpoint":  # Checkpointer._write(self, step, ...)
        from polo.runtime.checkpoint import Checkpointer

        _signal_before(Checkpointer, "_write", lambda args: args[1] == target, signum)
    else:
        raise ValueError(f"{spec!r}: the phase must be sampling, update, fit or checkpoint")


def _install_hold(path: str) -> None:
    """Make `polo train` wait for `path` to exist once it holds its lock, before set-up."""
    from polo.rl import train as module

    real_set_up = module.set_up

    def set_up(*args, **kwargs):
        """Return the real set-up's result, once PATH exists."""
        deadline = time.time() + 120
        while not Path(path).exists() and time.time() < deadline:
            time.sleep(0.05)
        return real_set_up(*args, **kwargs)

    module.set_up = set_up


if os.environ.get("POLO_TEST_SIGTERM"):
    _install_signal(os.environ["POLO_TEST_SIGTERM"], signal.SIGTERM)
if os.environ.get("POLO_TEST_SIGKILL"):
    _install_signal(os.environ["POLO_TEST_SIGKILL"], signal.SIGKILL)
if os.environ.get("POLO_TEST_HOLD_UNTIL"):
    _install_hold(os.environ["POLO_TEST_HOLD_UNTIL"])
