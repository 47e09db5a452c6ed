"""PPO's vanilla loss, with trainer rank 1 asleep for $RLM_SLOW_RANK_S seconds in its first loss of step
$RLM_SLOW_AT_STEP: a peer that stops answering, as a stuck rank or a mismatched collective looks to the others."""
import os
import time

from rlmegatron.algorithms.policy_loss import ppo_clip_policy_loss

calls = 0


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation,
                        rollout_is_weights=None):
    global calls
    calls += 1  # one loss per micro-batch; the test's steps have one micro-batch per rank
    if os.environ["RANK"] == "1" and calls == int(os.environ["RLM_SLOW_AT_STEP"]):
        time.sleep(float(os.environ["RLM_SLOW_RANK_S"]))
    return ppo_clip_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation,
                                rollout_is_weights)
