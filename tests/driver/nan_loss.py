"""PPO's vanilla loss for the first $RLM_NAN_AFTER calls, NaN after them: a loss that diverges mid-run while every
reward stays finite. Calls are counted in the rank process that computes the loss."""
import math
import os

from rlmegatron.algorithms.policy_loss import ppo_clip_policy_loss

calls = 0


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation,
                        rollout_is_weights=None):
    global calls
    calls += 1
    loss, metrics = ppo_clip_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation,
                                         rollout_is_weights)
    return (loss * math.nan if calls > int(os.environ["RLM_NAN_AFTER"]) else loss), metrics
