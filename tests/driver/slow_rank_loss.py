"""PPO's vanilla loss, with trainer rank 1 asleep for $RLM_SLOW_RANK_S seconds in its first call once the path
$RLM_SLOW_ONCE_EXISTS exists (a checkpoint of the step before): a peer that stops answering, as a stuck rank or a
mismatched collective looks to the others."""
import os
import time

from rlmegatron.algorithms.policy_loss import ppo_clip_policy_loss

slept = False


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation,
                        rollout_is_weights=None):
    global slept
    if os.environ["RANK"] == "1" and not slept and os.path.exists(os.environ["RLM_SLOW_ONCE_EXISTS"]):
        slept = True
        time.sleep(float(os.environ["RLM_SLOW_RANK_S"]))
    return ppo_clip_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation,
                                rollout_is_weights)
