"""polo.core: the policy-optimization maths as pure tensor functions (no I/O, no models)."""

from polo.core.advantages import (
    discounted_returns,
    expand_to_tokens,
    explained_variance,
    gae_advantages,
    group_advantages,
    informative_rows,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
    zero_spread_groups,
)
from polo.core.distributed import all_reduce_sum, global_count
from polo.core.preference import dpo_loss, pairwise_loss
from polo.core.shaping import overlong_penalty
from polo.core.trpo import backtracking_line_search, conjugate_gradient, fisher_vector_product, flat_grad, trust_region_step
from polo.core.kl import KL_ESTIMATORS, kl_estimate, kl_k1, kl_k2, kl_k3
from polo.core.losses import (
    AGGREGATIONS,
    aggregate_loss,
    entropy_from_logits,
    gspo_loss,
    masked_mean,
    masked_sum,
    ppo_clip_loss,
    value_loss,
    vanilla_pg_loss,
)

__all__ = [
    "backtracking_line_search",
    "conjugate_gradient",
    "fisher_vector_product",
    "flat_grad",
    "trust_region_step",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "aggregate_loss",
    "all_reduce_sum",
    "discounted_returns",
    "dpo_loss",
    "entropy_from_logits",
    "expand_to_tokens",
    "explained_variance",
    "gae_advantages",
    "global_count",
    "group_advantages",
    "informative_rows",
    "overlong_penalty",
    "pairwise_loss",
    "reinforce_pp_advantages",
    "token_level_rewards",
    "gspo_loss",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "masked_mean",
    "masked_sum",
    "ppo_clip_loss",
    "rloo_advantages",
    "value_loss",
    "vanilla_pg_loss",
    "whiten",
    "zero_spread_groups",
]
