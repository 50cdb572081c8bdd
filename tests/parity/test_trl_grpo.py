"""polo's GRPO-family update against TRL 1.16's own GRPOTrainer code, on identical inputs, in fp64 (trl_oracle.py).

Every setting the two share gives the same advantages and the same gradient at every optimizer step, to 1e-6
relative (max |polo − TRL| / max |TRL|). What is left is rounding: TRL's Bessel factor count / (count − 1) is an fp32
number (1.5e-8 relative), and TRL builds the sampler's log-probs from Python lists as fp32 (up to 1e-7 with the
sampler correction); everything else agrees to ~1e-15.
"""

from __future__ import annotations

import dataclasses

import pytest

trl = pytest.importorskip("trl", reason="TRL is the oracle of these tests: install polo's dev extras (trl==1.16.0)")

from trl_oracle import TRL_VERSION, Setting, make_data, polo_config, polo_train, relative_error, trl_train  # noqa: E402

TOLERANCE = 1e-6

# Each shared setting, with a cut of the batch into optimizer steps that exercises it. TRL's DAPO normaliser is the
# generation batch's tokens per optimizer step, polo's the step's own: they agree when one optimizer step takes the
# whole batch (test_trl_conventions.py shows the difference otherwise).
SHARED = {
    "grpo": Setting(),
    "grpo_minibatches": Setting(num_minibatches=4),  # one epoch cut into four optimizer steps
    "grpo_epochs": Setting(epochs=3, num_minibatches=2),
    "grad_accumulation": Setting(micro_batch_size=2, num_minibatches=2),  # 4 micro-batches per optimizer step
    "dapo": Setting(loss_type="dapo", epochs=2, learning_rate=10.0),  # a token mean: smaller steps than grpo's
    "clip_higher": Setting(loss_type="dapo", epsilon_high=0.28, epochs=3, learning_rate=10.0),
    "mask_truncated": Setting(loss_type="dapo", mask_truncated=True, epochs=2, learning_rate=10.0),
    # unscaled advantages and a sum over a constant: small gradients, so larger steps to reach the clip range
    "dr_grpo": Setting(loss_type="dr_grpo", scale_rewards="none", num_minibatches=2, epochs=2, learning_rate=30.0),
    "bnpo": Setting(loss_type="bnpo", micro_batch_size=2, num_minibatches=2, epochs=2),
    "scale_rewards_none": Setting(scale_rewards="none", num_minibatches=2, learning_rate=10.0),
    "gspo": Setting(sequence_ratio=True, epsilon_low=3e-4, epsilon_high=4e-4, num_minibatches=2),
    "gspo_epochs": Setting(sequence_ratio=True, epsilon_low=3e-4, epsilon_high=4e-4, epochs=2, micro_batch_size=2),
    "k3_beta": Setting(beta=0.1, epochs=2, num_minibatches=2),
    "k3_beta_gspo": Setting(sequence_ratio=True, beta=0.04, epsilon_low=3e-4, epsilon_high=4e-4, num_minibatches=2),
    "mask_truncated_grpo": Setting(mask_truncated=True, num_minibatches=2, beta=0.05),
    # the parts TRL has that polo gained
    "k3_importance_weighted": Setting(beta=0.1, use_bias_correction_kl=True, epochs=2, num_minibatches=2),
    "two_sided_clipping": Setting(delta=1.3, epochs=2, num_minibatches=2, learning_rate=10.0),
    "two_sided_clipping_gspo": Setting(
        delta=1.001, sequence_ratio=True, epsilon_low=3e-4, epsilon_high=4e-4, num_minibatches=2, epochs=2
    ),
    "cispo": Setting(loss_type="cispo", epsilon_high=0.5, epochs=3, learning_rate=10.0),
    "sapo": Setting(loss_type="sapo", epochs=2, num_minibatches=2),
    "scale_rewards_batch": Setting(scale_rewards="batch", num_minibatches=2, learning_rate=10.0),
    "top_entropy_quantile": Setting(top_entropy_quantile=0.2, micro_batch_size=8, num_minibatches=2, beta=0.05),
    # the entropy bonus: each micro-batch's mean entropy, whatever the loss's aggregation, on the tokens it trains
    "entropy_coef": Setting(entropy_coef=0.1, micro_batch_size=2, num_minibatches=2, epochs=2),
    "entropy_coef_dapo": Setting(loss_type="dapo", entropy_coef=0.3, epochs=2, learning_rate=10.0),
    "entropy_coef_top_entropy": Setting(entropy_coef=0.2, top_entropy_quantile=0.2, micro_batch_size=8, epochs=2),
    # LUSPO: GSPO's sequence ratio, each sequence's loss times its length (TRL: loss_type luspo, sequence level)
    "luspo": Setting(
        loss_type="luspo", sequence_ratio=True, epsilon_low=3e-4, epsilon_high=4e-4, num_minibatches=2, epochs=2
    ),
    "luspo_grad_accumulation": Setting(
        loss_type="luspo", sequence_ratio=True, epsilon_low=3e-4, epsilon_high=4e-4, micro_batch_size=2, epochs=2
    ),
    "luspo_token_ratio_k3": Setting(loss_type="luspo", beta=0.1, epochs=2, num_minibatches=2, learning_rate=1.0),
    # VESPO: a token mean like DAPO's, so one optimizer step per pass (see the DAPO normaliser above)
    "vespo": Setting(loss_type="vespo", epochs=3, learning_rate=10.0),
    "vespo_kernel": Setting(loss_type="vespo", vespo_kernel=(1.5, 2.5, 4.0, 1.0), epochs=2, micro_batch_size=2),
    "vespo_k3": Setting(loss_type="vespo", beta=0.1, epochs=2, learning_rate=10.0),
    # several rewards (of scales 1, 10, 100, some None) summed with weights, then normalised in the group (GRPO) ...
    "reward_weights": Setting(reward_weights=(1.0, 0.5, 0.02), epochs=2, num_minibatches=2),
    # ... or each normalised in its group, summed, and the sum normalised over the batch (GDPO)
    "gdpo": Setting(reward_weights=(1.0, 0.5, 0.02), multi_objective_aggregation="normalize_then_sum", epochs=2),
    "gdpo_dapo": Setting(
        loss_type="dapo",
        reward_weights=(2.0, -1.0),
        multi_objective_aggregation="normalize_then_sum",
        epochs=3,
        learning_rate=10.0,
    ),
    # the sampler's log-probs differ from the training forward's: each mode of the correction, with bounds that bite
    "sampler_token_truncate": Setting(sampler_correction="token_truncate", sampler_correction_bounds=(0.8, 1.5)),
    "sampler_token_mask": Setting(
        sampler_correction="token_mask", sampler_correction_bounds=(0.6, 1.6), epochs=2, num_minibatches=2
    ),
    "sampler_sequence_truncate": Setting(
        sampler_correction="sequence_truncate", loss_type="dapo", epochs=2, learning_rate=10.0
    ),
    "sampler_sequence_mask": Setting(
        sampler_correction="sequence_mask", sampler_correction_bounds=(0.5, None), num_minibatches=2, beta=0.05
    ),
    "sampler_gspo": Setting(
        sampler_correction="token_truncate",
        sequence_ratio=True,
        epsilon_low=3e-4,
        epsilon_high=4e-4,
        num_minibatches=2,
        epochs=2,
    ),
    # DeepSeek-V3.2's off-policy sequence mask, against the sampling policy's log-probs, then against the sampler's
    "off_policy_mask": Setting(off_policy_mask_threshold=0.02, epochs=3, num_minibatches=2),
    "off_policy_mask_sampler": Setting(
        off_policy_mask_threshold=0.05, sampler_correction="token_truncate", epochs=2, num_minibatches=2
    ),
}


@pytest.fixture(scope="module")
def eos(tiny_model_dir) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir)).eos_token_id


def test_the_oracle_is_the_pinned_trl():
    assert trl.__version__ == TRL_VERSION


@pytest.mark.parametrize("name", list(SHARED))
def test_polo_computes_what_trl_computes(name, tiny_model_dir, eos, tmp_path):
    setting = SHARED[name]
    data = make_data(setting, eos)
    polo, oracle = polo_train(setting, data), trl_train(setting, data, tiny_model_dir, tmp_path)

    steps = setting.num_minibatches * setting.epochs
    assert len(polo.gradients) == len(oracle.gradients) == steps
    assert relative_error(polo.advantages, oracle.advantages) <= TOLERANCE
    for step, (ours, theirs) in enumerate(zip(polo.gradients, oracle.gradients), start=1):
        assert relative_error(ours, theirs) <= TOLERANCE, f"optimizer step {step}"
    if steps > 1:  # later steps took ratios away from 1, and some were clipped: the clipped branch was compared
        clipped = oracle.metrics.get("clip_ratio/region_mean") or oracle.metrics.get("cispo_clip_ratio")
        if clipped is not None:  # SAPO clips nothing: its gate is smooth
            assert max(clipped) > 0 and polo.metrics["clip_fraction/low"] + polo.metrics["clip_fraction/high"] > 0
    if setting.loss_type == "vespo" and steps > 1:  # later steps weighted sequences by φ(w) away from φ(1) = 1
        assert min(oracle.metrics["vespo/phi_seq_mean"]) < 0.9
    if setting.sampler_correction is not None:  # the sampler's weights were not all 1
        ratios = (
            oracle.metrics["sampling/importance_sampling_ratio/min"]
            + oracle.metrics["sampling/importance_sampling_ratio/max"]
        )
        assert min(ratios) < 0.9 and max(ratios) > 1.1
    if setting.off_policy_mask_threshold is not None:  # some drifted completion was left out
        assert polo.metrics["off_policy/masked_fraction"] > 0
    if setting.mask_truncated:  # some completions were truncated, and left out of the loss
        assert data.truncated.any()


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("grpo_epochs", {"clip_eps_high": 0.28}),  # clip-higher on one side only
        ("k3_beta", {"beta": 0.09}),
        ("dr_grpo", {"loss_aggregation": "token_mean"}),
        ("grpo_minibatches", {"scale_rewards": False}),
        ("entropy_coef", {"entropy_coef": 0.12}),
        ("luspo", {"loss_aggregation": "seq_mean_token_mean"}),  # GSPO's sequence mean instead of LUSPO's sum
        ("vespo", {"policy_loss_options": {"lambda_neg": 2.5}}),
        ("gdpo", {"advantage_estimator": "grpo"}),  # the weighted sum normalised in its group instead
        ("sampler_token_truncate", {"sampler_correction_max": 1.4}),
        ("sampler_sequence_mask", {"sampler_correction": "token_mask"}),
        ("off_policy_mask", {"off_policy_mask_threshold": None}),
    ],
)
def test_the_comparison_catches_a_changed_setting(name, change, tiny_model_dir, eos, tmp_path):
    """Negative control: polo with one setting changed no longer matches TRL."""
    setting = SHARED[name]
    data = make_data(setting, eos)
    oracle = trl_train(setting, data, tiny_model_dir, tmp_path)
    changed = polo_train(setting, data, polo_config(setting, **change))
    errors = [relative_error(ours, theirs) for ours, theirs in zip(changed.gradients, oracle.gradients)]
    assert max(errors) > 1e3 * TOLERANCE, errors


def test_a_different_batch_is_caught_too(tiny_model_dir, eos, tmp_path):
    """Negative control on the data: TRL on another draw of rewards disagrees with polo."""
    setting = SHARED["grpo_epochs"]
    data = make_data(setting, eos)
    other = dataclasses.replace(data, rewards=make_data(setting, eos, seed=1).rewards)
    polo, oracle = polo_train(setting, data), trl_train(setting, other, tiny_model_dir, tmp_path)
    assert relative_error(polo.advantages, oracle.advantages) > 1e-2
