"""Rewards: rule-based GSM8K and math scores, dispatch by data source, custom functions, and managers."""
from rlmegatron.rewards.dispatch import UnknownDataSource, default_compute_score
from rlmegatron.rewards.gsm8k import extract_gsm8k_answer, gsm8k_score
from rlmegatron.rewards.manager import (
    DAPORewardManager,
    NaiveRewardManager,
    NonFiniteReward,
    RewardFunctionError,
    RewardInput,
    RewardResult,
    UnusableRewards,
    build_reward_manager,
    step_reward_metrics,
)
from rlmegatron.rewards.math_reward import last_boxed_answer, math_score, normalize_math_answer

__all__ = [
    "DAPORewardManager",
    "NaiveRewardManager",
    "NonFiniteReward",
    "RewardFunctionError",
    "RewardInput",
    "RewardResult",
    "UnknownDataSource",
    "UnusableRewards",
    "build_reward_manager",
    "default_compute_score",
    "extract_gsm8k_answer",
    "gsm8k_score",
    "last_boxed_answer",
    "math_score",
    "normalize_math_answer",
    "step_reward_metrics",
]
