"""Megatron's load-balanced context-parallel split of a sequence, and the gather of per-token results back.

A sequence whose length is a multiple of 2×CP is cut into 2×CP equal chunks; CP rank r holds chunk r and chunk
2×CP-1-r, so under a causal mask every rank does the same attention work. Megatron's rope
(`get_pos_emb_on_this_cp_rank`, `_get_thd_freqs_on_this_cp_rank`) and Transformer Engine's attention expect exactly
this layout.
"""
from __future__ import annotations

import torch


def chunk_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (0..length-1) that CP rank `rank` holds of a sequence of `length` tokens, in its local order."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens cannot be split into 2×{cp} context-parallel chunks")
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def gathered_positions(length: int, cp: int, device=None) -> torch.Tensor:
    """Positions of the tokens of all CP ranks concatenated in rank order (what an all-gather gives)."""
    return torch.cat([chunk_positions(length, cp, rank, device) for rank in range(cp)])


class _GatherTokens(torch.autograd.Function):
    """All-gather [n, T/CP] per-token results over the CP group into [n, T] in sequence order.

    Every CP rank computes the same loss from the gathered tensor, so the gradient of a rank's own tokens is its
    slice of the incoming gradient, taken as is (summing it over ranks would count the loss CP times).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, order: torch.Tensor, group) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(group.size())]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        gathered = torch.empty(local.shape[0], order.numel(), *local.shape[2:], dtype=local.dtype, device=local.device)
        gathered[:, order] = torch.cat(parts, dim=1)
        ctx.mine = order[group.rank() * local.shape[1] : (group.rank() + 1) * local.shape[1]]
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[:, ctx.mine], None, None


def gather_tokens(local: torch.Tensor, order: torch.Tensor, group) -> torch.Tensor:
    """`local` [n, T/CP, ...] of every CP rank -> [n, T, ...] where `order` [T] gives the sequence position of each
    column of the rank-order concatenation; differentiable."""
    return _GatherTokens.apply(local, order.to(local.device), group)
