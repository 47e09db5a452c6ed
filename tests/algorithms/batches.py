"""Random [batch, resp_len] test batches: right-padded masks, optional multi-turn holes, empty rows."""

from __future__ import annotations

import torch


def random_mask(
    batch: int, resp_len: int, generator: torch.Generator, holes: bool = False, allow_empty: bool = True
) -> torch.Tensor:
    """Float 0/1 mask, right-padded to random lengths; ``holes`` also masks random interior tokens."""
    low = 0 if allow_empty else 1
    lengths = torch.randint(low, resp_len + 1, (batch,), generator=generator)
    mask = (torch.arange(resp_len).unsqueeze(0) < lengths.unsqueeze(1)).double()
    if holes:
        mask = mask * (torch.rand(batch, resp_len, generator=generator, dtype=torch.float64) > 0.3).double()
    return mask


def outcome_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards holding each sequence's score on its last valid token (verl's outcome layout)."""
    rewards = torch.zeros_like(mask)
    last = (mask * torch.arange(mask.shape[-1], dtype=mask.dtype)).argmax(dim=-1)
    rewards[torch.arange(mask.shape[0]), last] = scores.to(mask.dtype)
    return rewards * mask
