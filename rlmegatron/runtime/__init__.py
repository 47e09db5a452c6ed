"""Device and process-group setup (cuda+nccl or cpu+gloo), the rank launcher, and the opt-in CPU layer."""
from rlmegatron.runtime.distributed import (
    Device,
    ParallelLayout,
    destroy_distributed,
    init_distributed,
    init_model_parallel,
    layout_scope,
)
from rlmegatron.runtime.launcher import RankFailure, run_ranks

__all__ = [
    "Device",
    "ParallelLayout",
    "RankFailure",
    "destroy_distributed",
    "init_distributed",
    "init_model_parallel",
    "layout_scope",
    "run_ranks",
]
