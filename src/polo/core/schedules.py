"""Learning-rate schedules as pure functions of the optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_multiplier(warmup_steps: int, total_steps: int, schedule: str) -> Callable[[int], float]:
    """Return the learning-rate multiplier per optimizer step: linear warm-up, then constant, linear or cosine to 0.

        m(s) = (s + 1) / (w + 1)                       s < w (warm-up steps w)
        m(s) = 1 | 1 − p | ½ (1 + cos π p)             p = min((s − w) / (T − w), 1)

    for the constant, linear and cosine schedules over T total optimizer steps.
    """

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return multiplier
