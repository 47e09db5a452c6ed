"""The critic's clipped value loss."""

from __future__ import annotations

import torch

from rlmegatron.algorithms.aggregation import LossAggregation, aggregate_loss
from rlmegatron.algorithms.masked import masked_mean


def clipped_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    aggregation: LossAggregation = LossAggregation(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * aggregated max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), as PPO / verl.

    ``vpreds`` are the critic's current predictions, ``values`` the ones recorded at rollout time.
    ``metrics["vf_clipfrac"]``: detached share of this micro-batch's tokens where the clipped
    error was the larger one.
    """
    vpreds_clipped = torch.minimum(torch.maximum(vpreds, values - cliprange_value), values + cliprange_value)
    unclipped_error = (vpreds - returns).square()
    clipped_error = (vpreds_clipped - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_error, clipped_error), response_mask, aggregation)
    return loss, {"vf_clipfrac": masked_mean((clipped_error > unclipped_error).float(), response_mask)}
