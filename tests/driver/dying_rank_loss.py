"""PPO's vanilla loss, whose trainer rank 1 kills its own process (SIGKILL, as the OOM killer does) in its first loss
once the path $RLM_DIE_ONCE_EXISTS exists (a checkpoint of an earlier step): mid-update; with $RLM_DIE_HOW=raise it
raises a RuntimeError instead, as a CUDA or NCCL error would. $RLM_DIE_MARKER counts the deaths across restarts; the
rank dies until it holds $RLM_DIE_TIMES lines."""
import os
import signal
from pathlib import Path

from rlmegatron.algorithms.policy_loss import ppo_clip_policy_loss


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation,
                        rollout_is_weights=None):
    marker = Path(os.environ["RLM_DIE_MARKER"])
    deaths = len(marker.read_text().splitlines()) if marker.exists() else 0
    if (os.environ["RANK"] == "1" and deaths < int(os.environ["RLM_DIE_TIMES"])
            and os.path.exists(os.environ["RLM_DIE_ONCE_EXISTS"])):
        with open(marker, "a") as out:
            out.write(f"{os.getpid()}\n")
        if os.environ.get("RLM_DIE_HOW") == "raise":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (a stand-in, raised on purpose)")
        os.kill(os.getpid(), signal.SIGKILL)
    return ppo_clip_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation,
                                rollout_is_weights)
