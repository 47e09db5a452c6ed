"""Save and resume: step checkpoints (weights, optimizer, RNG, dataloader, step) complete once their manifest is in,
resume from the newest one that loads, and the `latest` marker; and the run directory they live in (run_dir: its lock
and its disk)."""
from rlmegatron.checkpoint.integrity import CheckpointLoadFailed
from rlmegatron.checkpoint.manager import CheckpointError, CheckpointManager

__all__ = ["CheckpointError", "CheckpointLoadFailed", "CheckpointManager"]
