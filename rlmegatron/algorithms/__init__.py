"""RL post-training maths as pure torch functions: advantages, policy/value/KL losses, aggregation, registries."""

from rlmegatron.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlmegatron.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    global_denominator,
    local_denominator,
)
from rlmegatron.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
)
from rlmegatron.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten, zero_outside_mask
from rlmegatron.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    entropy_bonus,
    gspo_policy_loss,
    ppo_clip_policy_loss,
    truncated_importance_weights,
)
from rlmegatron.algorithms.registry import Registry, UnknownNameError
from rlmegatron.algorithms.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "LossAggregation",
    "PolicyLossConfig",
    "Registry",
    "UnknownNameError",
    "aggregate_loss",
    "apply_kl_penalty",
    "clipped_value_loss",
    "compute_advantages",
    "entropy_bonus",
    "gae_advantages",
    "global_denominator",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_loss",
    "local_denominator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "truncated_importance_weights",
    "zero_outside_mask",
]
