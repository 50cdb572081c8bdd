"""Drawing the next token from logits: temperature and nucleus (top-p) sampling.

Two entry points share one draw (`inverse_cdf_sample`): `sample_next_token`, the CPU sampler's,
which may look at the probabilities on the host to take a cheaper path; and `sample_on_device`,
the static sampler's, which never reads a value back (no host synchronisation, fixed shapes),
so it can run inside a captured decode step. Both draw one uniform per row from `generator`
(the device's default generator when None) and give the same token for the same uniform.
"""

from __future__ import annotations

import torch

NUCLEUS_CANDIDATES = 256


def sample_next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return one sampled token id per row from next-token `logits` (batch, vocab) -> (batch,).

    temperature 0 means greedy; top_p < 1 keeps the smallest set of tokens whose probability
    mass reaches top_p (nucleus sampling).
    """
    if temperature == 0:
        return logits.argmax(-1)
    probs = tempered_probs(logits, temperature)
    if top_p < 1.0:
        # The nucleus nearly always lies among the few hundred likeliest tokens: when those already
        # hold top_p of the mass in every row, sorting only them gives the same filter at a fraction
        # of the cost of sorting the whole vocabulary (measured: 0.03 s instead of 7.9 s).
        top_probs, top_ids = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)
        if bool((top_probs.sum(-1) >= top_p).all()):
            sorted_probs, sorted_ids = top_probs, top_ids
        else:
            sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        nucleus = nucleus_weights(sorted_probs, top_p)
        return sorted_ids.gather(-1, inverse_cdf_sample(nucleus, generator).unsqueeze(-1)).squeeze(-1)
    return inverse_cdf_sample(probs, generator)


def sample_on_device(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return one sampled token id per row from `logits` (batch, vocab) -> (batch,), never reading a value on the host.

    The same distribution and, for the same uniform, the same token as `sample_next_token`; top_p < 1
    sorts the whole vocabulary (the candidates shortcut needs a host-side check), which a GPU does cheaply.
    """
    if temperature == 0:
        return logits.argmax(-1)
    probs = tempered_probs(logits, temperature)
    if top_p < 1.0:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        nucleus = nucleus_weights(sorted_probs, top_p)
        return sorted_ids.gather(-1, inverse_cdf_sample(nucleus, generator).unsqueeze(-1)).squeeze(-1)
    return inverse_cdf_sample(probs, generator)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Return the log-prob of each drawn token under softmax(logits / temperature) in fp32, (batch, vocab) → (batch,).

    The distribution the trainer scores a completion under (its log-probs divide the logits by the same temperature;
    top-p's renormalisation is not part of it); at temperature 0 (greedy), the untempered one.
    """
    scaled = logits.float() if temperature in (0, 1.0) else logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def tempered_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Return softmax(logits / temperature) in fp32, (batch, vocab); at temperature 1 without a divided copy."""
    if temperature == 1.0:  # one pass over the (batch, vocab) logits instead of three (cast, divide, softmax)
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.softmax(logits.float() / temperature, dim=-1)


def nucleus_weights(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Return `sorted_probs` (batch, n), sorted descending, with every token outside the top-p nucleus set to 0."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    return sorted_probs.masked_fill(mass_before >= top_p, 0.0)


def inverse_cdf_sample(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Return one index per row drawn with probability proportional to `weights` (batch, n) -> (batch,).

    Draws u ~ U(0, Σw) and takes the first index whose cumulative weight exceeds u. Exact like
    torch.multinomial, and about 20x cheaper over a 49k vocabulary on a CPU (multinomial draws
    one exponential variate per vocabulary entry). The uniforms come from `generator`, on the
    weights' device (one per row, in row order).
    """
    cumulative = weights.cumsum(-1)
    uniform = torch.rand(weights.shape[0], 1, dtype=cumulative.dtype, device=cumulative.device, generator=generator)
    threshold = uniform * cumulative[:, -1:]
    # right=True skips zero-weight entries: their cumulative value equals their predecessor's.
    return torch.searchsorted(cumulative, threshold, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)
