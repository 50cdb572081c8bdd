"""Where polo and TRL 1.16 deliberately compute different things: each difference asserted, with the reading polo takes.

The inputs and both sides are those of test_trl_grpo.py (trl_oracle.py): TRL's own GRPOTrainer code against polo's.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is the oracle of these tests: install polo's dev extras (trl==1.16.0)")

from trl_oracle import Setting, make_data, polo_config, polo_train, relative_error, trl_train  # noqa: E402

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def eos(tiny_model_dir) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir)).eos_token_id


def test_dapo_normaliser_when_several_optimizer_steps_share_a_generation_batch(tiny_model_dir, eos, tmp_path):
    """DAPO (Yu et al. 2025, eq. 8) divides the token sum by the tokens of the batch the step trains on.

    polo reads that batch as the optimizer step's own minibatch: each step's loss is its own token mean. TRL divides
    every step by the generation batch's tokens over the number of optimizer steps (its average per step), so a
    step with more tokens than average gets a larger gradient. On the first step (ratio 1 on both sides) the two
    gradients differ by exactly that factor.
    """
    setting = Setting(loss_type="dapo", num_minibatches=2)
    data = make_data(setting, eos)
    polo, oracle = polo_train(setting, data), trl_train(setting, data, tiny_model_dir, tmp_path)
    lengths = torch.tensor([len(ids) for ids in data.completion_ids], dtype=torch.float64)
    first_step_tokens = lengths[: setting.batch_size // 2].sum()
    average_tokens = lengths.sum() / setting.num_minibatches
    assert first_step_tokens != average_tokens  # the batch was drawn so that the two readings differ
    assert relative_error(polo.gradients[0], oracle.gradients[0]) > 1e-3
    rescaled = polo.gradients[0] * first_step_tokens / average_tokens
    assert relative_error(rescaled, oracle.gradients[0]) <= TOLERANCE


def test_trl_weights_its_default_k3_by_the_importance_ratio(tiny_model_dir, eos, tmp_path):
    """TRL's default `use_bias_correction_kl=True` multiplies k3 by the ratio π/π_old (DeepSeek-V3.2, 2512.02556),
    which changes the KL's gradient even on-policy, where the ratio is 1: ∇(ρ k3) = ∇k3 + k3 ∇log π.

    polo's default k3 is the plain estimator (Schulman 2020): it differs from TRL's default on the very first step.
    `algorithm.kl_importance_weighted: true` is TRL's default (and test_trl_grpo compares the two over several steps).
    """
    setting = Setting(beta=0.1, use_bias_correction_kl=True)
    data = make_data(setting, eos)
    oracle = trl_train(setting, data, tiny_model_dir, tmp_path)
    plain = polo_train(setting, data, polo_config(setting, kl_importance_weighted=False))
    weighted = polo_train(setting, data)
    assert relative_error(plain.gradients[0], oracle.gradients[0]) > 1e-3
    assert relative_error(weighted.gradients[0], oracle.gradients[0]) <= TOLERANCE
    # how: on the first step the weight adds k3_it ∇log π(y_it), so on table entry (i, t) TRL's gradient is the plain
    # estimator's plus β k3_it / (|y_i| · B) under the GRPO aggregation
    batch, width = setting.batch_size, setting.max_completion_length
    lengths = torch.tensor([len(ids) for ids in data.completion_ids], dtype=torch.float64).unsqueeze(1)
    mask = torch.arange(width).unsqueeze(0) < lengths
    log_ratio = data.ref_logprobs - data.logprobs
    k3 = torch.where(mask, torch.expm1(log_ratio) - log_ratio, 0.0)
    ours = plain.gradients[0][: batch * width].view(batch, width)
    theirs = oracle.gradients[0][: batch * width].view(batch, width)
    assert relative_error(ours + setting.beta * k3 / (lengths * batch), theirs) <= TOLERANCE


def test_polo_guards_k3_against_overflow_above_a_log_ratio_of_20(tiny_model_dir, eos, tmp_path):
    """k3 = e^d − d − 1 with d = log π_ref − log π (Schulman 2020). polo clamps d at +20 so that e^d stays finite in
    any precision (fp16 overflows at d ≈ 11, fp32 at 88); TRL does not clamp. On a token with d = 25, TRL's KL
    gradient is e^25 − 1 ≈ 7e10 times β, polo's is 0; on every other row the two agree."""
    setting = Setting(beta=0.1)
    data = make_data(setting, eos)
    data.ref_logprobs[0, 0] = data.logprobs[0, 0] + 25.0
    polo, oracle = polo_train(setting, data), trl_train(setting, data, tiny_model_dir, tmp_path)
    width = setting.max_completion_length
    ours, theirs = polo.gradients[0][: setting.batch_size * width], oracle.gradients[0][: setting.batch_size * width]
    ours, theirs = ours.view(setting.batch_size, width), theirs.view(setting.batch_size, width)
    # TRL's gradient on that token: −β (e^25 − 1) / (its row's token count · sequences), plus the policy term
    assert theirs[0, 0] < -1e6 and abs(ours[0, 0]) < 1.0
    expected = -setting.beta * math.expm1(25.0) / len(data.completion_ids[0]) / setting.batch_size
    assert theirs[0, 0].item() == pytest.approx(expected + ours[0, 0].item(), rel=1e-9)
    assert relative_error(ours[1:], theirs[1:]) <= TOLERANCE


def test_trl_leaves_rounding_in_groups_whose_rewards_are_all_equal(tiny_model_dir, eos, tmp_path):
    """GRPO's advantage (r − mean) / (std + ε) (Shao et al. 2024, eq. in §4.1.2) is 0/ε for a group whose rewards are
    all equal. TRL computes it, and the rounding of the mean is left, divided by ε = 1e-4: rewards of 0.01 in fp32,
    as TRL's reward functions give them, yield advantages of ~1e-5 in a group of 8. polo sets such a group's
    advantages to exactly 0: the group carries no signal (DAPO's dynamic sampling drops it for the same reason)."""
    setting = Setting(group_size=8, prompts=2)
    data = make_data(setting, eos)
    rewards = data.rewards.float()
    rewards[:8] = 0.01
    data = dataclasses.replace(data, rewards=rewards)
    polo, oracle = polo_train(setting, data), trl_train(setting, data, tiny_model_dir, tmp_path)
    assert torch.equal(polo.advantages[:8], torch.zeros(8, dtype=polo.advantages.dtype))
    assert 1e-7 < oracle.advantages[:8].abs().max() < 1e-4
    assert relative_error(polo.advantages[8:].double(), oracle.advantages[8:].double()) <= TOLERANCE


def test_under_gspo_trl_weights_k3_by_the_sequence_ratio_polo_by_the_token_ratio(tiny_model_dir, eos, tmp_path):
    """DeepSeek-V3.2 (2512.02556) weights each token's k3 by that token's ratio π(y_t)/π_old(y_t). polo does
    so whatever the policy loss; TRL, under `importance_sampling_level="sequence"` (GSPO), uses the sequence ratio
    s_i = exp(mean_t log ρ_t) instead. Even on-policy (ρ = s = 1) the gradients differ: ∇(ρ_t k3_t) = ∇k3_t + k3_t
    ∇log π(y_t) puts a token's own k3 on it, while ∇(s_i Σ_t k3_t) spreads the row's mean k3 over its tokens. So on
    the first step, on table entry (i, t), TRL's gradient is polo's plus β (mean_t' k3_it' − k3_it) / (|y_i| · B)
    under the GRPO aggregation, and exactly that."""
    setting = Setting(sequence_ratio=True, epsilon_low=3e-4, epsilon_high=4e-4, beta=0.1, use_bias_correction_kl=True)
    data = make_data(setting, eos)
    polo, oracle = polo_train(setting, data), trl_train(setting, data, tiny_model_dir, tmp_path)
    batch, width = setting.batch_size, setting.max_completion_length
    ours = polo.gradients[0][: batch * width].view(batch, width)
    theirs = oracle.gradients[0][: batch * width].view(batch, width)
    assert relative_error(ours, theirs) > 1e-3
    lengths = torch.tensor([len(ids) for ids in data.completion_ids], dtype=torch.float64)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    log_ratio = data.ref_logprobs - data.logprobs
    k3 = torch.where(mask, torch.expm1(log_ratio) - log_ratio, 0.0)
    row_mean = k3.sum(-1, keepdim=True) / lengths.unsqueeze(1)
    shift = torch.where(mask, setting.beta * (row_mean - k3) / (lengths.unsqueeze(1) * batch), 0.0)
    assert relative_error(ours + shift, theirs) <= TOLERANCE
