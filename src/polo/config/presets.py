"""Algorithm presets: each algorithm is a set of `AlgorithmConfig` values over the one RL loop.

A preset names registered functions (`advantage_estimator`, `policy_loss`, `loss_aggregation`,
`kl_estimator`, see `polo.core.registry`) and the knobs around them; it is data, not code.
"""

from __future__ import annotations

from typing import Any

from polo.config.errors import ConfigError
from polo.core.registry import did_you_mean

# Each algorithm is a set of AlgorithmConfig values over the one loop. References: GRPO (Shao et al.
# 2024, DeepSeekMath); Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"); DAPO
# (Yu et al. 2025: eps_high 0.28, dynamic sampling, token-level loss, soft overlong punishment with
# a 4096-token buffer under a 20480 cap = 0.2); RLOO (Ahmadian et al. 2024); REINFORCE++ (Hu 2025:
# KL in the reward, batch-normalised returns); GSPO (Zheng et al. 2025: clip range 3e-4 / 4e-4); CISPO
# (MiniMax 2025: a token-level loss; the weight's cap 1 + 4 = ScaleRL's ε_max of 5, Khatri et al. 2025); SAPO
# (Qwen 2025: GRPO's sequence-mean loss with a soft gate for the clip, temperatures 1 and 1.05); LUSPO (Liu et
# al. 2026: GSPO's loss and clip range, each sequence's loss scaled by its length, so a sum per sequence); VESPO
# (arXiv 2602.10693: REINFORCE under a gamma kernel of the sequence ratio, its k and λ in policy_loss_options;
# a token mean, as TRL aggregates it);
# PPO for LMs (Ouyang et al. 2022; Stiennon et al. 2020). Every preset names its four registered
# parts (polo.core.registry) explicitly, so a reader goes from the name straight to the functions;
# the paper names live here, the functions are named for what they compute.
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {
        "advantage_estimator": "grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "seq_mean_token_mean",
        "kl_estimator": "k3",
    },
    "dr_grpo": {
        "advantage_estimator": "grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "seq_mean_token_sum_norm",
        "kl_estimator": "k3",
        "scale_rewards": False,
    },
    "dapo": {
        "advantage_estimator": "grpo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "kl_estimator": "k3",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong_buffer": 0.2,
        "beta": 0.0,
    },
    "rloo": {
        "advantage_estimator": "rloo",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "seq_mean_token_mean",
        "kl_estimator": "k3",
    },
    "reinforce_pp": {
        "advantage_estimator": "reinforce_pp",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "kl_estimator": "k1",
        "kl_in_reward": True,
        "beta": 0.01,
    },
    "gspo": {
        "advantage_estimator": "grpo",
        "policy_loss": "gspo",
        "loss_aggregation": "seq_mean_token_mean",
        "kl_estimator": "k3",
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
    },
    "cispo": {
        "advantage_estimator": "grpo",
        "policy_loss": "cispo",
        "loss_aggregation": "token_mean",
        "kl_estimator": "k3",
        "clip_eps_high": 4.0,
    },
    "sapo": {
        "advantage_estimator": "grpo",
        "policy_loss": "sapo",
        "loss_aggregation": "seq_mean_token_mean",
        "kl_estimator": "k3",
    },
    "luspo": {
        "advantage_estimator": "grpo",
        "policy_loss": "gspo",
        "loss_aggregation": "seq_mean_token_sum",
        "kl_estimator": "k3",
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
    },
    "vespo": {
        "advantage_estimator": "grpo",
        "policy_loss": "vespo",
        "loss_aggregation": "token_mean",
        "kl_estimator": "k3",
    },
    "ppo": {
        "advantage_estimator": "gae",
        "policy_loss": "ppo_clip",
        "loss_aggregation": "token_mean",
        "kl_estimator": "k1",
        "kl_in_reward": True,
        "beta": 0.05,
        "gamma": 1.0,
        "lam": 0.95,
    },
}


# `algorithm.loss_aggregation` once took paper names; each still works and is read as the aggregation
# named for what it computes (config.yaml records the new name). A run's config.yaml, and the copy in
# every checkpoint and model card, names them, and `polo train config.yaml` must repeat that run.
# "bnpo" is TRL's loss_type, the local (micro-)batch's token mean (polo's bnpo used to be token_mean, as dapo).
LOSS_AGGREGATION_ALIASES: dict[str, str] = {
    "grpo": "seq_mean_token_mean",
    "dapo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "bnpo": "micro_batch_token_mean",
}


def apply_preset(data: dict) -> dict:
    """Return recipe data whose `algorithm` section is the named preset under the recipe's own keys.

    An old `loss_aggregation` name (`LOSS_AGGREGATION_ALIASES`) becomes the name of what it computes.
    """
    algorithm = data.get("algorithm") or {}
    if not isinstance(algorithm, dict):
        raise ConfigError(f"algorithm: expected a mapping of AlgorithmConfig fields, got {algorithm!r}")
    name = algorithm.get("name", "grpo")
    if name not in PRESETS:
        raise ConfigError(
            f"algorithm.name: {name!r} is not one of {', '.join(PRESETS)}{did_you_mean(str(name), PRESETS)}"
        )
    merged = {**PRESETS[name], **algorithm, "name": name}
    aggregation = merged.get("loss_aggregation")
    if isinstance(aggregation, str) and aggregation in LOSS_AGGREGATION_ALIASES:
        merged["loss_aggregation"] = LOSS_AGGREGATION_ALIASES[aggregation]
    return {**data, "algorithm": merged}
