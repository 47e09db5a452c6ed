"""Library warnings (and log lines) that tell a user of rlmegatron nothing they can act on, silenced in the ranks by
their exact text or logger: left alone, each rank prints them while it starts, and Ray prints its deduplicated
copies again when the job ends, below the run's results. Any other warning still shows."""
from __future__ import annotations

import logging
import warnings

# (category, start of the message); the comment above each says why it tells a user nothing
EVERYWHERE = (
    # Megatron-Core 0.16's own TransformerConfig default (cuda_graph_scope="full") trips its own deprecation.
    (UserWarning, r"full scope is deprecated"),
    # Megatron-Core's DistributedOptimizer.zero_grad visits its parameter-shard views, which are not leaves (its
    # source says so: "throws grad-access warning"); reading .grad there is harmless.
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    # torch 2.13 renamed these collectives; Megatron-Core calls the old names, and the oldest torch supported has
    # only those.
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
    # Megatron-Core's dist_checkpointing (resumed checkpoints; the reference and critic start as copies of the actor)
    # loads through torch's deprecated torch.distributed.checkpoint.load_state_dict and ShardedTensor.
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load`"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # Experts at expert TP 1 beside TP > 1 dense layers (gpt-oss's biased experts need it): Megatron-Core builds
    # their linears with the model's sequence_parallel and turns it off for them itself, as it should.
    (UserWarning, r"`sequence_parallel` is set to `True`, but tensor model parallel size is 1"),
)
CPU_ONLY = (
    # Transformer Engine and Apex are GPU libraries: a CPU rank runs Megatron-Core's torch fallbacks by design.
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed"),
)


# Loggers whose messages repeat what the run reports anyway, raised from the call they log in.
REPEATED = (
    # Megatron's checkpoint writer logs a write that failed (a full disk: "unexpected pos 704 vs 598"), then raises
    # it; the driver says it once, as the full disk it was (rlmegatron.checkpoint.run_dir.no_space_left).
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)


def import_notices_off(device: str) -> str:
    """PYTHONWARNINGS for a process that imports Megatron-Core before it can call quiet_library_notices (the fork
    server, transport.local_ranks): the notices printed at import. Their texts are plain (-W takes no regex)."""
    return ",".join(f"ignore:{message}:{category.__name__}" for category, message in CPU_ONLY if device == "cpu")


def quiet_library_notices(device: str) -> None:
    """Silence the notices above in this process (a rank), before Megatron-Core is imported."""
    for category, message in EVERYWHERE + (CPU_ONLY if device == "cpu" else ()):
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in REPEATED:
        logging.getLogger(name).setLevel(logging.CRITICAL)
