"""Device and process-group setup (cuda+nccl or cpu+gloo) and the opt-in CPU layer, for every process that runs torch.distributed."""
from rlmegatron.runtime.distributed import (
    Device,
    ParallelLayout,
    destroy_distributed,
    init_distributed,
    init_model_parallel,
    layout_scope,
)

__all__ = [
    "Device",
    "ParallelLayout",
    "destroy_distributed",
    "init_distributed",
    "init_model_parallel",
    "layout_scope",
]
