"""Clipped value loss, mirroring verl.trainer.ppo.core_algos.compute_value_loss (0.5 * agg of the max)."""

import torch
from torch.testing import assert_close

from rlmegatron.algorithms import LossAggregation, clipped_value_loss

from .batches import random_mask


def test_clipped_value_loss_by_hand():
    vpreds = torch.tensor([[1.0, 2.0, 0.0, 5.0]], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([[0.5, 2.0, 0.2, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, metrics = clipped_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    # token 0: clip(1.0, 0.3, 0.7) = 0.7; (1 - 2)^2 = 1 vs (0.7 - 2)^2 = 1.69 -> 1.69 (clipped)
    # token 1: clip(2.0, 1.8, 2.2) = 2.0; both (2 - 1)^2 = 1
    # token 2: clip(0.0, 0.0, 0.4) = 0.0; both 0
    # 0.5 * (1.69 + 1 + 0) / 3 = 0.448333
    assert_close(loss, torch.tensor(0.5 * 2.69 / 3, dtype=torch.float64))
    assert_close(metrics["vf_clipfrac"], torch.tensor(1 / 3))
    loss.backward()
    # token 0's active branch is the clipped (constant) prediction -> 0; token 1: 0.5 * 2 * (2 - 1) / 3
    assert_close(vpreds.grad, torch.tensor([[0.0, 1 / 3, 0.0, 0.0]], dtype=torch.float64))


def test_clipped_value_loss_matches_its_formula_on_random_inputs():
    generator = torch.Generator().manual_seed(12)
    vpreds = torch.randn(5, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    values = vpreds.detach() + 0.4 * torch.randn(5, 6, generator=generator, dtype=torch.float64)
    returns = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    mask = random_mask(5, 6, generator, holes=True)
    mask[0, 0] = 1.0
    aggregation = LossAggregation("seq-mean-token-sum")
    loss, _ = clipped_value_loss(vpreds, returns, values, mask, 0.25, aggregation)
    clipped = values + (vpreds - values).clamp(-0.25, 0.25)
    per_token = torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2) * mask
    non_empty = (mask.sum(-1) > 0).sum()
    assert_close(loss, 0.5 * per_token.sum() / non_empty)
