"""MiniMax-M2's query/key norm over all heads: at TP=2 the same outputs and gradients as one rank's whole norm."""
from __future__ import annotations

import torch

from rlmegatron.transport.local_ranks import run_ranks

HEADS, HEAD_DIM, TOKENS = 4, 8, 6


def _inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, 1, HEADS, HEAD_DIM, generator=generator) * 3
    weight = torch.rand(HEADS * HEAD_DIM, generator=generator) + 0.5
    upstream = torch.randn(TOKENS, 1, HEADS, HEAD_DIM, generator=generator)
    return x, weight, upstream


def _reference():
    """transformers' MiniMaxM2RMSNorm over the flattened heads, and its gradients."""
    x, weight, upstream = _inputs()
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    flat = x.flatten(-2)
    out = weight * flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    (out.view_as(x) * upstream).sum().backward()
    return out.view_as(x).detach(), x.grad, weight.grad


def norm_job(tp: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from rlmegatron.models.all_heads_norm import AllHeadsRMSNorm
    from rlmegatron.runtime import ParallelLayout
    from rlmegatron.runtime.distributed import init_model_parallel

    init_model_parallel(ParallelLayout(tp=tp))
    rank = ps.get_tensor_model_parallel_rank()
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=HEADS, tensor_model_parallel_size=tp, use_cpu_initialization=True)
    norm = AllHeadsRMSNorm(config, HEAD_DIM, eps=1e-6)
    x, weight, upstream = _inputs()
    local = slice(rank * HEADS // tp, (rank + 1) * HEADS // tp)
    with torch.no_grad():
        norm.weight.copy_(weight.view(HEADS, HEAD_DIM)[local].flatten())
    x = x[:, :, local].clone().requires_grad_()
    out = norm(x)
    (out * upstream[:, :, local]).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "weight_grad": norm.weight.grad,
            "tp_sharded": (norm.weight.tensor_model_parallel, norm.weight.partition_dim),
            "sharded_axis": norm.sharded_state_dict(prefix="q.")["q.weight"].axis_fragmentations}


def test_the_norm_over_all_heads_at_tp2_gives_the_whole_norms_outputs_and_gradients():
    out, x_grad, weight_grad = _reference()
    ranks = run_ranks(norm_job, 2, 2)
    assert torch.allclose(torch.cat([r["out"] for r in ranks], dim=2), out, atol=1e-6)
    # Each rank's input gradient has the other rank's heads' share of the mean square in it (the backward's sum).
    assert torch.allclose(torch.cat([r["x_grad"] for r in ranks], dim=2), x_grad, atol=1e-6)
    assert torch.allclose(torch.cat([r["weight_grad"] for r in ranks]), weight_grad, atol=1e-6)
    assert all(r["tp_sharded"] == (True, 0) for r in ranks)
    assert all(r["sharded_axis"] == (2,) for r in ranks)  # saved as the two halves of one tensor
