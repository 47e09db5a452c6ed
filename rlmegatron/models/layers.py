"""Modules the local (non-Transformer-Engine) layer spec uses in place of Megatron-Core's, on CPU and GPU alike.

`SDPACoreAttention` (separate k/v head dims, as MLA needs, and packed sequences),
`SequenceParallelTorchNorm` (a torch norm that allows sequence parallelism) and
`DuplicatedLinear` (MLA's replicated down projections, as TE's 'duplicated' mode);
`enable_local_mla` lets Megatron's MLA take DuplicatedLinear for those projections.
"""
from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

_LOCAL_MLA = False


def enable_local_mla() -> None:
    """Let Megatron-Core's MLA build its down projections from DuplicatedLinear when Transformer Engine is absent
    (idempotent). Call before building an MLA model from the local spec."""
    global _LOCAL_MLA
    if _LOCAL_MLA or importlib.util.find_spec("transformer_engine") is not None:
        return
    # Without TE, megatron.core.extensions substitutes MagicMocks, so MLA's isinstance(x, TELinear) raises.
    multi_latent_attention.HAVE_TE = False
    # MLA only offers its replicated ('duplicated') down projections for TELinear; the
    # ColumnParallelLinear fallback loses the TP sum of the rope-key gradient at TP>1.
    multi_latent_attention.TELinear = DuplicatedLinear
    _LOCAL_MLA = True


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention on torch SDPA; supports k and v head dims that differ (MLA)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__()
        if config.context_parallel_size > 1:
            raise NotImplementedError("context parallelism needs Transformer Engine attention")
        self.config = config
        kv_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if query.dim() == 3:  # packed THD input [tokens, heads, dim]: one sequence of all tokens
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        # Megatron layout [s, b, heads, dim] -> SDPA layout [b, heads, s, dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.size(1) != q.size(1):
            repeat = q.size(1) // k.size(1)
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        mask = _causal_mask(q.size(2), q.device)
        if packed_seq_params is not None:
            mask = mask & _same_sequence_mask(packed_seq_params.cu_seqlens_q, q.size(2), q.device)
        elif attention_mask is not None:
            mask = mask & ~attention_mask.bool()  # Megatron's mask marks positions to hide.
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
        )
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _causal_mask(seq_len: int, device) -> torch.Tensor:
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def _same_sequence_mask(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """Block-diagonal mask for packed (THD) batches: tokens attend only within their own sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    if seq_id.numel() < total:  # tail padding after the last sequence forms its own block
        seq_id = torch.cat([seq_id, seq_id.new_full((total - seq_id.numel(),), lengths.numel())])
    return seq_id[:, None] == seq_id[None, :]


class SequenceParallelTorchNorm:
    """torch LayerNorm/RMSNorm that, unlike WrappedTorchNorm, allows sequence parallelism.

    With sequence parallelism each TP rank normalises a slice of the sequence, so
    the norm's weight gradients are partial: marking them `sequence_parallel` makes
    Megatron's finalize_model_grads all-reduce them across the TP group.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization={config.normalization!r} is not supported on CPU")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class DuplicatedLinear(torch.nn.Module):
    """A linear layer replicated on every TP rank (TE's parallel_mode='duplicated'), for MLA down projections.

    Under sequence parallelism each rank sees a slice of the sequence, so its weight
    gradient is partial: `sequence_parallel` on the weight makes finalize_model_grads
    sum it across the TP group.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 skip_bias_add: bool = False, parallel_mode: str = "duplicated", **_unused):
        super().__init__()
        if bias:
            raise ValueError("DuplicatedLinear serves MLA down projections, which have no bias")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {},  # replicated across TP: no sharded axis
            sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
