"""RMSNorm over all of a token's query (or key) heads together: MiniMax-M2's q_norm and k_norm.

Megatron-Core's qk_layernorm normalises each head on its own (Qwen3's, GLM's); MiniMax-M2 normalises the whole
projected query (num_attention_heads x head_dim) and key (num_key_value_heads x head_dim) of a token as one vector.
At TP > 1 each rank holds only its heads, so the mean square is averaged over the TP group (every rank holds as
many heads), and the weight is split with the heads: a TP-sharded parameter along dim 0, like the QKV rows it
scales, which Megatron's gradient-norm and checkpoint code then treat as such.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

QUERY, KEY = "query", "key"


class _SummedOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces too: each rank's share of the sum reaches every rank's output, so
    its gradient is the sum of theirs. (Megatron's reduce_from_tensor_model_parallel_region passes the gradient
    through unreduced, right only when what follows is the same on every rank.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class AllHeadsRMSNorm(MegatronModule):
    """RMSNorm of [..., local heads, head_dim] over its last two dims, the mean square averaged over TP ranks.

    Built by Megatron's SelfAttention in place of q_layernorm / k_layernorm (models.spec puts it there for a family
    whose qk_norm_over_all_heads is set); `heads` says which of the two, since both get the same hidden_size (the
    head size)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, heads: str = QUERY):
        super().__init__(config)
        tp = config.tensor_model_parallel_size
        count = config.num_attention_heads if heads == QUERY else config.num_query_groups
        if count % tp:
            # Megatron replicates key heads over the ranks when there are fewer than TP; their norm weight would then
            # be a replicated slice of a sharded tensor, which no rule here writes.
            raise ValueError(f"{heads} norm over all heads: {count} {heads} heads cannot be split over TP={tp}")
        self.eps = eps
        self.tp = tp
        self.weight = torch.nn.Parameter(torch.ones(count // tp * hidden_size, dtype=config.params_dtype))
        # What Megatron's own TP-sharded weights carry: counted once per TP rank in the gradient norm, and not
        # all-reduced over TP as sequence-parallel norms are (every rank sees the whole sequence here).
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0
        self.weight.partition_stride = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2)
        mean_square = flat.float().pow(2).mean(-1, keepdim=True)
        if self.tp > 1:
            mean_square = _SummedOverRanks.apply(mean_square, parallel_state.get_tensor_model_parallel_group()) / self.tp
        normed = flat.float() * torch.rsqrt(mean_square + self.eps)
        return (self.weight * normed.to(x.dtype)).view(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0}, sharded_offsets)
