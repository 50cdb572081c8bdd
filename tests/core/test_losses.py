"""Policy/value losses and loss aggregation against numbers worked out by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from polo.core import (
    POLICY_LOSSES,
    LossNormalisers,
    PolicyLossInputs,
    aggregate_loss,
    cispo_loss,
    entropy_from_logits,
    gspo_loss,
    high_entropy_tokens,
    masked_mean,
    masked_sum,
    ppo_clip_loss,
    sapo_loss,
    value_loss,
    vanilla_pg_loss,
    vespo_loss,
)
from polo.core.losses import VespoSettings

# A 2×3 PPO example with clip-higher: eps_low = 0.2, eps_high = 0.28 → clip range [0.8, 1.28].
RATIOS = torch.tensor([[1.5, 1.1, 0.5], [0.5, 1.5, 2.0]])
ADVANTAGES = torch.tensor([[2.0, 1.0, -1.0], [1.0, -1.0, 5.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# Row 0: t0 −min(1.5·2, 1.28·2) = −2.56 (clipped high)    t1 −min(1.1, 1.1) = −1.1
#        t2 −min(0.5·−1, 0.8·−1) = 0.8 (clipped low)
# Row 1: t0 −min(0.5·1, 0.8·1) = −0.5 (ρ < 0.8 but A > 0: not clipped)
#        t1 −min(1.5·−1, 1.28·−1) = 1.5 (ρ > 1.28 but A < 0: not clipped)    t2 padding → 0
PPO_EXPECTED = torch.tensor([[-2.56, -1.1, 0.8], [-0.5, 1.5, 0.0]])


def _ppo(ratios=RATIOS, advantages=ADVANTAGES, old_logprobs=None):
    old_logprobs = torch.zeros_like(ratios) if old_logprobs is None else old_logprobs
    logprobs = (ratios.log() + old_logprobs).requires_grad_()
    per_token, stats = ppo_clip_loss(logprobs, old_logprobs, advantages, MASK, 0.2, 0.28)
    per_token.sum().backward()
    return per_token, stats, logprobs.grad


def test_ppo_clip_loss_by_hand():
    per_token, stats, grad = _ppo()
    torch.testing.assert_close(per_token, PPO_EXPECTED)
    assert stats["clip_low_count"].item() == 1
    assert stats["clip_high_count"].item() == 1
    assert stats["token_count"].item() == 5
    # ratio_sum = 1.5 + 1.1 + 0.5 + 0.5 + 1.5 = 5.1 (padding excluded).
    assert stats["ratio_sum"].item() == pytest.approx(5.1)
    # d(−ρA)/d log π = −ρA where unclipped; clipped tokens and padding get no gradient.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.1, 0.0], [-0.5, 1.5, 0.0]]))


def test_ppo_sequence_advantages_broadcast_to_tokens():
    sequence_advantages = torch.tensor([1.0, -1.0])
    per_sequence, _, _ = _ppo(advantages=sequence_advantages)
    per_token, _, _ = _ppo(advantages=sequence_advantages.unsqueeze(-1).expand(2, 3))
    torch.testing.assert_close(per_sequence, per_token)
    with pytest.raises(ValueError, match="advantages must be"):
        _ppo(advantages=torch.zeros(3))


def test_ppo_padding_never_contributes():
    _, _, grad = _ppo()
    garbage_old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, float("nan")]])
    garbage_advantages = ADVANTAGES.clone()
    garbage_advantages[1, 2] = float("inf")
    garbage_ratios = RATIOS.clone()
    garbage_ratios[1, 2] = 1e30
    per_token, stats, garbage_grad = _ppo(garbage_ratios, garbage_advantages, garbage_old)
    torch.testing.assert_close(per_token, PPO_EXPECTED)
    torch.testing.assert_close(garbage_grad, grad)
    assert stats["ratio_sum"].item() == pytest.approx(5.1)


@pytest.mark.parametrize("name, loss", [("ppo_clip", ppo_clip_loss), ("gspo", gspo_loss)])
def test_registered_policy_losses_take_their_clip_range_from_the_settings(name, loss):
    """The loop hands a loss (inputs, settings); the built-ins read the recipe's clip range from the settings."""
    settings = SimpleNamespace(clip_eps_low=0.2, clip_eps_high=0.28, clip_delta=None)
    logprobs = RATIOS.log()
    inputs = PolicyLossInputs(logprobs, torch.zeros_like(logprobs), ADVANTAGES, MASK)
    per_token, stats = POLICY_LOSSES[name](inputs, settings)
    expected, expected_stats = loss(logprobs, torch.zeros_like(logprobs), ADVANTAGES, MASK, 0.2, 0.28)
    torch.testing.assert_close(per_token, expected)
    assert stats == expected_stats
    # Every ratio 1.5 with A > 0: clipped at 1 + clip_eps_high, which the settings set.
    hot = PolicyLossInputs(torch.full_like(logprobs, math.log(1.5)), torch.zeros_like(logprobs), ADVANTAGES.abs(), MASK)
    wide, _ = POLICY_LOSSES[name](hot, settings)
    narrow, _ = POLICY_LOSSES[name](hot, SimpleNamespace(clip_eps_low=0.2, clip_eps_high=0.1, clip_delta=None))
    torch.testing.assert_close(narrow, wide * 1.1 / 1.28)


def test_gspo_ratio_is_exp_of_mean_log_ratio():
    old_logprobs = torch.zeros(2, 3)
    logprobs = torch.tensor([[0.1, 0.3, 5.0], [-0.4, -0.2, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # Row 0: mean(0.1, 0.3) = 0.2 (padding ignored) → s = e^0.2; row 1: mean = −0.2 → s = e^−0.2.
    per_token, stats = gspo_loss(logprobs, old_logprobs, torch.tensor([1.0, 1.0]), mask, 0.9, 10.0)
    s0, s1 = math.exp(0.2), math.exp(-0.2)
    torch.testing.assert_close(per_token, torch.tensor([[-s0, -s0, 0.0], [-s1, -s1, -s1]]))
    assert stats["ratio_sum"].item() == pytest.approx(2 * s0 + 3 * s1)
    # Seq-mean-token-mean recovers −mean_i s_i A_i; d/d log π_t = −s_i A_i / |y_i| / num_sequences.
    loss = aggregate_loss(per_token, mask, "seq_mean_token_mean", LossNormalisers(2, 5, 3))
    loss.backward()
    expected_grad = torch.tensor([[-s0 / 2, -s0 / 2, 0.0], [-s1 / 3, -s1 / 3, -s1 / 3]]) / 2
    torch.testing.assert_close(logprobs.grad, expected_grad)


def test_gspo_clips_whole_sequences():
    logprobs = torch.tensor([[0.1, 0.3, 5.0], [-0.4, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # Clip range [0.9, 1.1]. Row 0: s = 1.2214 > 1.1, A = +1 → −1.1 per token (clipped high).
    # Row 1: s = 0.8187 < 0.9, A = −1 → −min(−0.8187, −0.9) = 0.9 per token (clipped low).
    per_token, stats = gspo_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, 0.1, 0.1)
    torch.testing.assert_close(per_token, torch.tensor([[-1.1, -1.1, 0.0], [0.9, 0.9, 0.9]]))
    assert stats["clip_high_count"].item() == 2
    assert stats["clip_low_count"].item() == 3


def test_vanilla_pg_loss_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, float("nan")]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # −A·log π: −2·(−1) = 2, −2·(−2) = 4, −(−1)·(−0.5) = −0.5, padding 0.
    expected = torch.tensor([[2.0, 4.0], [-0.5, 0.0]])
    torch.testing.assert_close(vanilla_pg_loss(logprobs, torch.tensor([2.0, -1.0]), mask), expected)


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 100.0]])
    old_values = torch.tensor([[0.5, 2.5, 0.0]])
    returns = torch.tensor([[3.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # t0: (1 − 3)² = 4; clipped V = 0.5 + 0.2 = 0.7, (0.7 − 3)² = 5.29 → ½·5.29 = 2.645.
    # t1: (2 − 1)² = 1; clipped V = 2.5 − 0.2 = 2.3, (2.3 − 1)² = 1.69 → ½·1.69 = 0.845.
    clipped = value_loss(values, old_values, returns, mask, clip_range=0.2)
    torch.testing.assert_close(clipped, torch.tensor([[2.645, 0.845, 0.0]]))
    unclipped = value_loss(values, old_values, returns, mask, clip_range=None)
    torch.testing.assert_close(unclipped, torch.tensor([[2.0, 0.5, 0.0]]))


# Three sequences, one of them empty; max_completion_length 4; padding holds junk.
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 100.0, float("nan")], [float("nan")] * 4])
AGG_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
NORMALISERS = LossNormalisers(num_sequences=3, num_tokens=6, max_completion_length=4)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("seq_mean_token_mean", (2.5 + 5.5 + 0.0) / 3),  # per-sequence token means 2.5, 5.5, 0 (empty) over 3
        ("token_mean", 21 / 6),  # 1 + 2 + 3 + 4 + 5 + 6 = 21 over 6 tokens
        ("seq_mean_token_sum_norm", 21 / (3 * 4)),  # 21 over 3 sequences × 4 max tokens
        ("micro_batch_token_mean", 21 / 6 / 1),  # this micro-batch's 6 tokens, the step's only micro-batch
        ("seq_mean_token_sum", 21 / 3),  # per-sequence sums 10, 11, 0 (empty) over 3
    ],
)
def test_aggregation_modes_by_hand(mode, expected):
    loss = aggregate_loss(PER_TOKEN, AGG_MASK, mode, NORMALISERS)
    assert not torch.isnan(loss)
    assert loss.item() == pytest.approx(expected)


def random_batch():
    generator = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=generator)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [0] * 5, [1] * 4 + [0], [1] + [0] * 4, [1] * 2 + [0] * 3])
    return per_token, mask


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum"])
def test_micro_batches_sum_to_full_batch(mode):
    per_token, mask = random_batch()
    full = aggregate_loss(per_token, mask, mode, LossNormalisers(6, int(mask.sum()), 5, num_micro_batches=1))
    normalisers = LossNormalisers(6, int(mask.sum()), 5, num_micro_batches=2)
    micro_batches = (slice(0, 2), slice(2, 6))
    halves = sum(aggregate_loss(per_token[rows], mask[rows], mode, normalisers) for rows in micro_batches)
    torch.testing.assert_close(halves, full)


def test_micro_batch_token_mean_averages_each_micro_batchs_own_token_mean():
    """TRL's bnpo: the token count is the local batch's, so the result depends on how the step is cut."""
    per_token, mask = random_batch()
    micro_batches = (slice(0, 2), slice(2, 6))  # 8 and 7 valid tokens
    normalisers = LossNormalisers(6, int(mask.sum()), 5, num_micro_batches=2)
    summed = sum(
        aggregate_loss(per_token[rows], mask[rows], "micro_batch_token_mean", normalisers) for rows in micro_batches
    )
    means = [masked_mean(per_token[rows], mask[rows]) for rows in micro_batches]
    torch.testing.assert_close(summed, (means[0] + means[1]) / 2)
    whole = aggregate_loss(per_token, mask, "micro_batch_token_mean", LossNormalisers(6, 15, 5, num_micro_batches=1))
    torch.testing.assert_close(whole, aggregate_loss(per_token, mask, "token_mean", normalisers))  # one micro-batch
    assert not torch.allclose(summed, whole)  # two micro-batches of 8 and 7 tokens weigh their tokens unequally
    empty = aggregate_loss(per_token[2:3], mask[2:3], "micro_batch_token_mean", normalisers)
    assert empty.item() == 0.0  # a micro-batch without valid tokens adds nothing


@pytest.mark.parametrize(
    "mode",
    ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "micro_batch_token_mean", "seq_mean_token_sum"],
)
def test_aggregation_padding_has_no_effect_on_gradients(mode):
    clean = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], requires_grad=True)
    junk = torch.tensor([[1.0, 2.0, 7.0], [3.0, -8.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    normalisers = LossNormalisers(num_sequences=2, num_tokens=3, max_completion_length=3)
    clean_loss = aggregate_loss(clean**2, mask, mode, normalisers)
    junk_loss = aggregate_loss(junk**2, mask, mode, normalisers)
    clean_loss.backward()
    junk_loss.backward()
    torch.testing.assert_close(junk_loss, clean_loss)
    torch.testing.assert_close(junk.grad, clean.grad)


def test_aggregation_errors_name_the_bad_value():
    with pytest.raises(
        ValueError,
        match=r"'seq_mean' is not a registered loss aggregation.*registered: seq_mean_token_mean, token_mean",
    ):
        aggregate_loss(PER_TOKEN, AGG_MASK, "seq_mean", NORMALISERS)
    with pytest.raises(ValueError, match="num_tokens must be a positive count.*0"):
        aggregate_loss(PER_TOKEN, AGG_MASK, "token_mean", LossNormalisers(3, 0, 4))
    with pytest.raises(ValueError, match="num_micro_batches must be a positive count.*0"):
        aggregate_loss(PER_TOKEN, AGG_MASK, "micro_batch_token_mean", LossNormalisers(3, 6, 4, num_micro_batches=0))


def test_masked_helpers():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert masked_sum(values, mask).item() == 4.0
    assert masked_mean(values, mask).item() == 2.0
    # Per-row: row 0 → (1 + 3)/2 = 2; row 1 has no valid entries → 0, not NaN.
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([2.0, 0.0]))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_entropy_from_logits():
    # Uniform over 4 → ln 4; two equal logits and one banned (−inf) → ln 2.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 3.0, float("-inf"), float("-inf")]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    torch.testing.assert_close(entropy, torch.tensor([math.log(4), math.log(2)]))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # Large logits must not overflow: softmax([1000, 0]) is essentially one-hot → entropy ≈ 0.
    assert entropy_from_logits(torch.tensor([1000.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)


def test_two_sided_clipping_bounds_a_negative_advantage_at_delta():
    # A < 0 and ratio 3: PPO's min keeps the unclipped 3·A (loss 3·|A|, gradient through the ratio); with δ = 2
    # the ratio in that term is capped: loss 2·|A| and no gradient (INTELLECT-2's two-sided clipping).
    logprobs = torch.full((1, 2), math.log(3.0), requires_grad=True)
    mask, advantages = torch.ones(1, 2), torch.tensor([-1.5])
    plain, _ = ppo_clip_loss(logprobs, torch.zeros(1, 2), advantages, mask, 0.2, 0.2)
    capped, _ = ppo_clip_loss(logprobs, torch.zeros(1, 2), advantages, mask, 0.2, 0.2, delta=2.0)
    torch.testing.assert_close(plain, torch.full((1, 2), 4.5))
    torch.testing.assert_close(capped, torch.full((1, 2), 3.0))
    capped.sum().backward()
    assert torch.equal(logprobs.grad, torch.zeros(1, 2))
    # Below δ, and for positive advantages, nothing changes.
    small = torch.full((1, 2), math.log(1.5))
    for sign in (-1.0, 1.0):
        a, _ = ppo_clip_loss(small, torch.zeros(1, 2), sign * advantages.abs(), mask, 0.2, 0.2)
        b, _ = ppo_clip_loss(small, torch.zeros(1, 2), sign * advantages.abs(), mask, 0.2, 0.2, delta=2.0)
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="delta"):
        ppo_clip_loss(small, torch.zeros(1, 2), advantages, mask, 0.2, 0.2, delta=1.0)


def test_cispo_keeps_every_tokens_gradient_with_a_capped_weight():
    # Ratios 0.5, 1, 3 and 9 under a cap of 5: weights 0.5, 1, 3, 5; the gradient is −w·A per token, even where
    # the ratio is far outside PPO's clip range (there PPO's gradient would be 0).
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[0.5, 1.0, 3.0, 9.0]])).requires_grad_()
    advantages, mask = torch.tensor([2.0]), torch.ones(1, 4)
    per_token, stats = cispo_loss(logprobs, old, advantages, mask, max_ratio=5.0)
    per_token.sum().backward()
    torch.testing.assert_close(logprobs.grad, -2.0 * torch.tensor([[0.5, 1.0, 3.0, 5.0]]))
    assert stats["clip_high_count"].item() == 1.0 and stats["ratio_sum"].item() == pytest.approx(13.5)
    settings = SimpleNamespace(clip_eps_low=0.2, clip_eps_high=4.0, clip_delta=None)
    registered, _ = POLICY_LOSSES["cispo"](PolicyLossInputs(logprobs.detach(), old, advantages, mask), settings)
    torch.testing.assert_close(registered, per_token.detach())


def test_sapo_is_ppos_gradient_on_policy_and_a_smooth_gate_off_it():
    # ∂l/∂ρ = −4σ(τ(ρ − 1))(1 − σ(τ(ρ − 1))) A: −A at ρ = 1, and it fades (without a cliff) as ρ leaves 1.
    advantages, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    ratios = torch.tensor([[1.0, 1.5, 3.0], [1.0, 1.5, 3.0]])
    logprobs = ratios.log().requires_grad_()
    per_token, stats = sapo_loss(logprobs, torch.zeros(2, 3), advantages, mask, 1.0, 1.05)
    per_token.sum().backward()
    tau = torch.tensor([[1.0], [1.05]])
    gate = torch.sigmoid(tau * (ratios - 1))
    # d l / d log π = ρ · ∂l/∂ρ
    torch.testing.assert_close(logprobs.grad, -4 * gate * (1 - gate) * ratios * advantages[:, None])
    assert logprobs.grad[0, 0].item() == pytest.approx(-1.0) and logprobs.grad[1, 0].item() == pytest.approx(1.0)
    assert stats["ratio_sum"].item() == pytest.approx(11.0)


def test_high_entropy_tokens_keeps_the_top_quantile_of_valid_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.8, 0.2, 0.7]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # the 7.0 is padding: never kept, never counted
    # 7 valid tokens, sorted 0.1 0.2 0.3 0.5 0.7 0.8 0.9: their 75th percentile interpolates 0.7 and 0.8 to 0.75
    kept = high_entropy_tokens(entropy, mask, 0.25)
    assert kept.tolist() == [[False, True, False, False], [False, True, False, False]]
    assert torch.equal(high_entropy_tokens(entropy, mask, 1.0), mask.bool())


def test_luspo_is_gspo_with_each_sequences_loss_scaled_by_its_length():
    # GSPO writes sequence i's loss L_i on each of its tokens; summing per sequence gives |y_i| L_i (LUSPO).
    generator = torch.Generator().manual_seed(0)
    logprobs, old = torch.randn(3, 4, generator=generator), torch.randn(3, 4, generator=generator)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    advantages = torch.tensor([1.0, -0.5, 2.0])
    per_token, _ = gspo_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    sequence_loss = masked_mean(per_token, mask, dim=-1)  # L_i
    normalisers = LossNormalisers(num_sequences=3, num_tokens=7, max_completion_length=4)
    luspo = aggregate_loss(per_token, mask, "seq_mean_token_sum", normalisers)
    torch.testing.assert_close(luspo, (mask.sum(-1) * sequence_loss).sum() / 3)


def test_vespo_weights_reinforce_by_a_gamma_kernel_of_the_sequence_ratio():
    # Sequence log-ratios 0 (on-policy), log 2 and log 0.5 over their valid tokens: φ(w) = w^k e^{λ(1 − w)}.
    options = VespoSettings()  # k 2, λ 3 for A ≥ 0; k 3, λ 2 for A < 0
    old = torch.zeros(3, 2)
    logprobs = torch.tensor([[0.3, -0.3], [math.log(2.0), 0.0], [math.log(0.5), 5.0]]).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])  # row 2's 5.0 is padding: not in its ratio
    advantages = torch.tensor([1.0, 1.0, -2.0])
    per_token, stats = vespo_loss(logprobs, old, advantages, mask, options)
    per_token.sum().backward()
    weights = torch.tensor([1.0, 2.0**2 * math.exp(3 * (1 - 2.0)), 0.5**3 * math.exp(2 * (1 - 0.5))])
    # the gradient is −φ(w_i) A_i on every valid token: the weight carries none
    expected = -(weights * advantages)[:, None] * mask
    torch.testing.assert_close(logprobs.grad, expected)
    assert stats["weight_sum"].item() == pytest.approx(float((weights[:, None] * mask).sum()))
    # on-policy the kernel is 1: REINFORCE itself
    torch.testing.assert_close(per_token[0], vanilla_pg_loss(logprobs, advantages, mask)[0])
    # far off-policy, either way, the weight vanishes instead of overflowing
    far = torch.tensor([[200.0], [-200.0]])
    extreme, _ = vespo_loss(
        far.requires_grad_(), torch.zeros(2, 1), torch.tensor([1.0, 1.0]), torch.ones(2, 1), options
    )
    assert torch.equal(extreme, torch.zeros(2, 1))
