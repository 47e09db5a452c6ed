"""Save and resume: atomic step checkpoints (weights, optimizer, RNG, dataloader, step) and the `latest` marker."""
from rlmegatron.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager"]
