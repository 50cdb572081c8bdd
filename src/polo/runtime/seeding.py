"""Seeding and saving/restoring the random-number generators (torch CPU and CUDA, numpy, python)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """Return this process's random-number-generator states: torch CPU, each CUDA device's (CUDA in use), numpy, python.

    The CUDA states are read only once CUDA is initialised: asking earlier would start a CUDA
    context in a run that never used the GPU. Every state is a CPU tensor or plain data, so a
    checkpoint holding them loads on any machine.
    """
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Set this process's random-number generators to a state from `rng_state`.

    A CUDA state is restored where this machine has CUDA (device i from state i, for the devices
    both have) and skipped where it has none: a GPU run resumes on a CPU machine, and a CPU run's
    state (no "cuda" entry) leaves the GPUs' generators as seeding set them.
    """
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's generators (torch.manual_seed seeds every CUDA device too)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
