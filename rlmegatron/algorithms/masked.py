"""Masked reductions (sum, mean, variance, whitening) over the valid tokens of a [batch, resp_len] tensor.

Masks are 0/1 indicators (bool or float). Positions where the mask is 0 are excluded with
``torch.where`` rather than multiplied away, so garbage there (``-inf`` log-probs of padding, NaN)
cannot leak into a result or its gradient.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8  # added to the variance before rsqrt, as verl's masked_whiten does


def zero_outside_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is set, exactly 0 elsewhere (gradient 0 there too)."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over positions where ``mask`` is set (over everything, or along ``dim``)."""
    kept = zero_outside_mask(values, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def mask_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of set positions in ``mask`` (int64, exact at any batch size)."""
    valid = mask.bool()
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over set positions; an all-empty mask (or row, with ``dim``) gives 0 instead of NaN."""
    return masked_sum(values, mask, dim) / mask_count(mask, dim).clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all set positions; ``unbiased`` applies Bessel's n/(n-1) correction (verl's default).

    With fewer than two valid elements the variance is 0. verl raises there instead; we avoid the
    host sync that check needs, and 0 is the honest answer for a single sample's spread.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean).square(), mask)
    if unbiased:
        count = mask_count(mask)
        variance = variance * count / (count - 1).clamp(min=1)
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, unbiased: bool = True
) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with masked statistics; masked positions come back as 0.

    ``shift_mean=False`` keeps the original mean and only rescales the spread.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask, unbiased=unbiased) + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return zero_outside_mask(whitened, mask)
