"""Seeding and saving/restoring the random-number generators (torch, numpy, python)."""

from __future__ import annotations

import random

import numpy as np
import torch

def rng_state() -> dict:
    """Return this process's random-number-generator states (torch, numpy, python)."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}



def restore_rng(state: dict) -> None:
    """Set this process's random-number generators to a state from `rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])



def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
