"""masked_sum / masked_mean / masked_var / masked_whiten, mirroring verl.utils.torch_functional's masked helpers."""

import math

import torch
from torch.testing import assert_close

from rlmegatron.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

from .batches import random_mask


def test_masked_mean_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    # (1 + 2 + 3) / 3 = 2; the 100 under the mask is ignored
    assert_close(masked_mean(values, mask), torch.tensor(2.0))
    assert_close(masked_sum(values, mask), torch.tensor(6.0))


def test_masked_mean_per_row_and_empty_row():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    # row 0: 1/1 = 1; row 1: (3 + 4)/2 = 3.5; row 2 is empty -> 0 (not NaN)
    assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.0, 3.5, 0.0]))
    assert_close(masked_mean(values, torch.zeros_like(mask)), torch.tensor(0.0))


def test_garbage_under_the_mask_does_not_leak_into_value_or_gradient():
    values = torch.tensor([[1.0, float("nan"), float("-inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    result = masked_mean(values, mask)
    result.backward()
    assert result.item() == 1.0
    assert_close(values.grad, torch.tensor([[1.0, 0.0, 0.0]]))


def test_masked_var_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2; squared deviations 1, 0, 1 -> biased 2/3; Bessel: * 3/2 -> 1
    assert_close(masked_var(values, mask, unbiased=False), torch.tensor(2.0 / 3.0))
    assert_close(masked_var(values, mask), torch.tensor(1.0))


def test_masked_var_of_one_element_is_zero():
    # verl raises here; a single sample has no spread, and whitening it gives 0
    values, mask = torch.tensor([[7.0, 3.0]]), torch.tensor([[1.0, 0.0]])
    assert masked_var(values, mask).item() == 0.0
    assert masked_whiten(values, mask).abs().sum().item() == 0.0


def test_masked_whiten_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, unbiased var 1 -> (v - 2) / sqrt(1 + 1e-8); masked slot -> 0
    scale = 1.0 / math.sqrt(1.0 + 1e-8)
    assert_close(masked_whiten(values, mask), torch.tensor([[-scale, 0.0, scale, 0.0]]))
    # shift_mean=False puts the mean 2 back: 2 - 1, 2, 2 + 1
    assert_close(masked_whiten(values, mask, shift_mean=False), torch.tensor([[2 - scale, 2.0, 2 + scale, 0.0]]))


def test_against_the_definitions_on_random_inputs():
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        values = torch.randn(6, 9, generator=generator, dtype=torch.float64)
        mask = random_mask(6, 9, generator, holes=True)
        mask[0, :3] = 1.0  # at least a few valid tokens
        selected = values[mask.bool()]
        assert_close(masked_mean(values, mask), selected.mean())
        assert_close(masked_var(values, mask), selected.var(unbiased=True))
        assert_close(masked_var(values, mask, unbiased=False), selected.var(unbiased=False))
        whitened = masked_whiten(values, mask)
        assert_close(whitened[mask.bool()], (selected - selected.mean()) / (selected.var() + 1e-8).sqrt())
        assert whitened[~mask.bool()].abs().sum().item() == 0.0
        rows = [values[i][mask[i].bool()] for i in range(6)]
        expected_rows = torch.stack([r.mean() if r.numel() else torch.tensor(0.0, dtype=torch.float64) for r in rows])
        assert_close(masked_mean(values, mask, dim=-1), expected_rows)
