"""Reward shaping that depends on the completion, not the answer: DAPO's overlong punishment."""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: float, penalty: float = 1.0
) -> torch.Tensor:
    """Return DAPO's soft overlong punishment `(batch,)`, a reward term in [−penalty, 0].

                  ⎧ 0                                   |y| ≤ L_max − L_cache
        R(y)  =   ⎨ (L_max − L_cache − |y|) / L_cache   L_max − L_cache < |y| ≤ L_max
                  ⎩ −1                                  |y| > L_max

    times `penalty`, with L_max = `max_length` and L_cache = `buffer_length` (Yu et al. 2025,
    "DAPO", eq. 13). Completions stop at L_max here, so a truncated one scores −penalty and
    length shaping starts only in the last `buffer_length` tokens.
    Shapes: lengths (batch,) → (batch,) float32.
    """
    if buffer_length <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    start = max_length - buffer_length
    ramp = (start - lengths.float()) / buffer_length
    return penalty * ramp.clamp(min=-1.0, max=0.0)
