"""The token filters (repetition penalty, top-k, top-p, min-p) against transformers' own logits processors."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from polo.generation.sampling import (
    Context,
    Decoding,
    candidate_weights,
    inverse_cdf_sample,
    penalise_repetition,
    sample_next_token,
    sample_on_device,
    tempered_probs,
)

VOCAB = 300


def random_logits(seed: int, rows: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64) * 3


def polo_distribution(logits: torch.Tensor, decoding: Decoding) -> torch.Tensor:
    """Return the normalised distribution (rows, vocab) polo draws from: its filtered weights in vocab order."""
    weights, ids = candidate_weights(tempered_probs(logits, decoding.temperature), decoding)
    if ids is not None:
        weights = torch.zeros_like(logits, dtype=weights.dtype).scatter(-1, ids, weights)
    return weights / weights.sum(-1, keepdim=True)


def transformers_distribution(logits: torch.Tensor, processors: list) -> torch.Tensor:
    """Return softmax of the logits transformers' processors leave (filtered tokens at -inf)."""
    processed = LogitsProcessorList(processors)(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())
    return torch.softmax(processed, dim=-1)


def assert_same_distribution(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens kept
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-8)  # polo's probabilities are fp32


@pytest.mark.parametrize("top_k", [1, 7, 50, VOCAB, VOCAB + 5])
def test_top_k_keeps_what_transformers_keeps(top_k):
    logits = random_logits(top_k)
    ours = polo_distribution(logits, Decoding(1, top_k=top_k))
    assert_same_distribution(ours, transformers_distribution(logits, [TopKLogitsWarper(top_k)]))
    assert int((ours[0] > 0).sum()) == min(top_k, VOCAB)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_keeps_what_transformers_keeps(top_p):
    logits = random_logits(int(top_p * 100))
    ours = polo_distribution(logits, Decoding(1, top_p=top_p))
    assert_same_distribution(ours, transformers_distribution(logits, [TopPLogitsWarper(top_p)]))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_keeps_what_transformers_keeps(min_p):
    logits = random_logits(int(min_p * 1000))
    ours = polo_distribution(logits, Decoding(1, min_p=min_p))
    assert_same_distribution(ours, transformers_distribution(logits, [MinPLogitsWarper(min_p)]))
    assert ours.shape == logits.shape and bool((ours.argmax(-1) == logits.argmax(-1)).all())  # the likeliest stays


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(0.7, 40, 0.9, 0.05), (1.3, 10, 0.5, 0.2), (1.0, 200, 0.95, 0.0), (0.5, 0, 0.8, 0.3), (2.0, 25, 1.0, 0.1)],
)
def test_the_chain_is_transformers_generate_order(temperature, top_k, top_p, min_p):
    """Temperature, then top-k, then top-p over what top-k kept, then min-p: transformers' `generate` order."""
    logits = random_logits(top_k + int(100 * top_p))
    processors = [TemperatureLogitsWarper(temperature)]
    processors += [TopKLogitsWarper(top_k)] if top_k else []
    processors += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    processors += [MinPLogitsWarper(min_p)] if min_p > 0 else []
    decoding = Decoding(1, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    assert_same_distribution(polo_distribution(logits, decoding), transformers_distribution(logits, processors))


def test_top_p_after_top_k_renormalises_what_top_k_kept():
    """A nucleus of 0.5 over top-2 probabilities (0.4, 0.3): 0.4 / 0.7 > 0.5, so only the first token stays (over the
    whole vocabulary the mass before the second, 0.4, is below 0.5 and it would stay too)."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64))
    assert (polo_distribution(logits, Decoding(1, top_k=2, top_p=0.5)) > 0).tolist() == [[True, False, False, False]]
    assert (polo_distribution(logits, Decoding(1, top_p=0.5)) > 0).tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers_on_the_real_tokens(penalty):
    """Each row's context, padding left out, penalised as transformers penalises the same row without padding."""
    logits = random_logits(5, rows=3)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 12), generator=generator)
    ids[0, 3] = ids[0, 4]  # a token seen twice is penalised once
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, 9:] = 0  # columns not written yet
    ours = penalise_repetition(logits, ids, mask, penalty)
    for row in range(3):
        real = ids[row][mask[row].bool()][None]
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(real, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], theirs, rtol=0, atol=0)
    padded_only = set(ids[1, :5].tolist()) - set(ids[1, 5:].tolist())
    assert padded_only and all(ours[1, token] == logits[1, token] for token in padded_only)


def test_repetition_penalty_without_a_context_is_one_clear_error():
    with pytest.raises(ValueError, match="repetition penalty needs the tokens seen so far"):
        sample_next_token(random_logits(0), Decoding(1, repetition_penalty=1.2))


SETTINGS = [
    {},
    {"top_k": 5},
    {"top_p": 0.6},
    {"min_p": 0.2},
    {"repetition_penalty": 1.5},
    {"top_k": 30, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.2, "temperature": 0.8},
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_host_and_device_draws_agree_and_stay_inside_the_kept_tokens(settings):
    """Both entry points give the same token for the same uniform, and only ever a token the filters kept."""
    logits = random_logits(9, rows=2).float().repeat(2000, 1)
    ids = torch.randint(0, VOCAB, (logits.shape[0], 6), generator=torch.Generator().manual_seed(1))
    context = Context(ids, torch.ones_like(ids))
    host = sample_next_token(logits, Decoding(1, generator=torch.Generator().manual_seed(4), **settings), context)
    device = sample_on_device(logits, Decoding(1, generator=torch.Generator().manual_seed(4), **settings), context)
    assert torch.equal(host, device)
    penalised = penalise_repetition(logits, ids, context.mask, settings.get("repetition_penalty", 1.0))
    kept = polo_distribution(penalised.double(), Decoding(1, **settings)) > 0
    assert bool(kept.gather(1, host[:, None]).all())
    plain = sample_next_token(logits, Decoding(1, generator=torch.Generator().manual_seed(4)))
    if {"top_k", "top_p", "min_p"} & set(settings):  # a filter that cuts leaves out tokens the plain draw reaches
        assert not bool(kept.gather(1, plain[:, None]).all())
    if "repetition_penalty" in settings:  # a penalty above 1 draws the context's tokens less often
        repeats = (host[:, None] == ids).any(-1).float().mean()
        assert repeats < 0.8 * (plain[:, None] == ids).any(-1).float().mean()


def test_the_defaults_draw_what_the_plain_tempered_draw_draws():
    """top_k 0, min_p 0 and repetition_penalty 1 change nothing: the same tokens as softmax + inverse CDF."""
    logits = random_logits(3, rows=64).float()
    for temperature in (1.0, 0.7):
        ours = sample_next_token(logits, Decoding(1, temperature, generator=torch.Generator().manual_seed(2)))
        plain = inverse_cdf_sample(tempered_probs(logits, temperature), torch.Generator().manual_seed(2))
        assert torch.equal(ours, plain)
    assert torch.equal(sample_next_token(logits, Decoding(1, 0.0)), logits.argmax(-1))
