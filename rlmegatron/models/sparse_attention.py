"""DeepSeek Sparse Attention (DeepSeek-V3.2; GLM-5 shares it): multi-latent attention in which each query attends only
to the index_topk keys its lightning indexer scores highest among those it may see.

The indexer is DeepSeek's, as transformers computes it: from the layer's input x and the MLA's normed low-rank
query qr, index_n_heads query heads q = wq_b(qr) and one key k = LayerNorm(wk(x)), rotary embedding (the rotate-half
kind, on the first qk_rope_head_dim dimensions of each), and score(s, t) = sum over heads h of
weights_proj(x)[s, h] / sqrt(index_n_heads) * relu(q_h(s) . k(t)) / sqrt(index_head_dim). (DeepSeek's own kernel
rotates q and k by a Hadamard transform first and scores in FP8; the transform is orthogonal, so the scores are the
same up to the FP8 rounding, which transformers leaves out too.) The indexer is frozen here: DeepSeek trains it with a
KL loss of its own against the main attention, and transformers runs it without gradients; RL trains the attention
it selects for.

Megatron-Core's MLA hands its core attention x and qr when config.experimental_attention_variant is "dsa"; this module
is that core attention, on this package's SDPA attention (models.layers.SDPACoreAttention): padded and packed
micro-batches alike, the selection a mask beside the causal one.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from rlmegatron.models.layers import SDPACoreAttention


class LightningIndexer(torch.nn.Module):
    """The indexer's weights (replicated over TP, frozen) and the keys it selects for each query."""

    def __init__(self, config):
        super().__init__()
        heads, dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.heads, self.dim, self.rope_dim, self.topk = heads, dim, config.qk_pos_emb_head_dim, config.dsa_indexer_topk
        dtype = config.params_dtype
        self.linear_wq_b = torch.nn.Linear(config.q_lora_rank, heads * dim, bias=False, dtype=dtype)
        self.linear_wk = torch.nn.Linear(config.hidden_size, dim, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, heads, bias=False, dtype=dtype)
        for param in self.parameters():
            param.requires_grad_(False)
        # GLM-5's indexer rotates interleaved pairs (as DeepSeek's MLA does), DeepSeek-V3.2's the two halves.
        self.interleaved = getattr(config, "dsa_indexer_rope_interleaved", False)
        self.config = config
        self._tables: dict[int, tuple[torch.Tensor, float]] = {}

    @torch.no_grad()
    def selected(self, qr: torch.Tensor, x_q: torch.Tensor, x_k: torch.Tensor, q_positions: torch.Tensor,
                 k_positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """[n, Lq, Lk] booleans: the keys among `allowed` ([n, Lq, Lk]) each query attends to. qr [n, Lq, q_lora]
        and x_q [n, Lq, hidden] are the queries' tokens, x_k [n, Lk, hidden] the keys', at positions q_positions
        [n or 1, Lq] and k_positions [Lk]."""
        n, lq, lk = allowed.shape
        q = self.linear_wq_b(qr).view(n, lq, self.heads, self.dim)
        k = self.k_norm(self.linear_wk(x_k)).unsqueeze(2)  # [n, Lk, 1, dim]
        q = self._rotated(q, q_positions.expand(n, lq))
        k = self._rotated(k, k_positions.expand(n, lk)).squeeze(2)
        # transformers' products in its order: [n, Lq, heads, Lk] scores, weighted by [n, Lq, 1, heads].
        scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))) * self.dim ** -0.5
        weights = self.linear_weights_proj(x_q).float() * self.heads ** -0.5
        index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2).masked_fill(~allowed, float("-inf"))
        chosen = index.topk(min(self.topk, lk), dim=-1).indices
        return allowed & torch.zeros_like(allowed).scatter(-1, chosen, True)

    def _rotated(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half rotary embedding on the first rope_dim dims of t [n, L, heads, dim] at positions [n, L]."""
        table, scale = self._table(int(positions.max()) + 1)
        angles = table.to(t.device)[positions]  # [n, L, rope_dim]
        cos, sin = ((f(angles) * scale).unsqueeze(2).to(t.dtype) for f in (torch.cos, torch.sin))
        rot, rest = t[..., : self.rope_dim], t[..., self.rope_dim:]
        half = self.rope_dim // 2
        if self.interleaved:  # pairs (0, 1), (2, 3), ...; the result's halves as transformers lays them out
            first, second, cos, sin = rot[..., 0::2], rot[..., 1::2], cos[..., :half], sin[..., :half]
            return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
        return torch.cat([rot * cos + torch.cat([-rot[..., half:], rot[..., :half]], dim=-1) * sin, rest], dim=-1)

    def _table(self, length: int) -> tuple[torch.Tensor, float]:
        """The rotary angles [length, rope_dim] (each frequency twice, rotate-half's layout) and the attention
        factor, from the model's rope (Megatron's own embeddings, which its MLA rotates with)."""
        size = 1 << max(length - 1, 1).bit_length()  # a few tables per run, not one per length
        if size not in self._tables:
            c = self.config
            if c.rope_type == "yarn":
                rotary = YarnRotaryEmbedding(
                    self.rope_dim, rotary_base=c.rotary_base, scaling_factor=c.rotary_scaling_factor,
                    original_max_position_embeddings=c.original_max_position_embeddings, beta_fast=c.beta_fast,
                    beta_slow=c.beta_slow, mscale=c.mscale, mscale_all_dim=c.mscale_all_dim,
                    use_cpu_initialization=True)
                emb, scale = rotary(size)
            else:
                emb, scale = RotaryEmbedding(self.rope_dim, rotary_percent=1.0, rotary_base=c.rotary_base,
                                             use_cpu_initialization=True)(size), 1.0
            self._tables[size] = (emb.reshape(size, self.rope_dim).float(), float(scale))
        return self._tables[size]


class SparseSDPACoreAttention(SDPACoreAttention):
    """MLA's core attention with DeepSeek Sparse Attention's selection: the indexer's top-k keys of each query."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        self.indexer = LightningIndexer(config)
        self.sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        self._inputs: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, x=None, qr=None):
        if self.sequence_parallel:  # MLA's input and low-rank query hold this rank's share of the tokens
            group = parallel_state.get_tensor_model_parallel_group()
            x, qr = (gather_from_sequence_parallel_region(t, group=group) for t in (x, qr))
        # Packed input comes as [tokens, 1, hidden] and [tokens, q_lora]; padded as [s, b, hidden] and [s, b, q_lora].
        self._inputs = (x.reshape(x.size(0), -1, x.size(-1)), qr.reshape(x.size(0), -1, qr.size(-1)))
        try:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        finally:
            self._inputs = None

    def _sdpa(self, q, k, v, mask, q_positions=None, k_positions=None, rows=None):
        x, qr = self._inputs
        lq, lk = q.size(-2), k.size(-2)
        q_pos = torch.arange(lq, device=q.device) if q_positions is None else q_positions
        k_pos = torch.arange(lk, device=q.device) if k_positions is None else k_positions
        allowed = (q_pos[..., :, None] >= k_pos) if mask is None else mask
        allowed = allowed.reshape(-1, lq, lk).expand(q.size(0), lq, lk)
        if rows is None:  # a padded batch: [s, b, .] in order
            x_q = x_k = x.transpose(0, 1)
            qr_q = qr.transpose(0, 1)
        else:
            q_rows, k_rows = rows
            x_q, x_k, qr_q = x[:, 0][q_rows], x[:, 0][k_rows], qr[:, 0][q_rows]
        selected = self.indexer.selected(qr_q, x_q, x_k, q_pos.reshape(-1, lq), k_pos, allowed)
        return self._masked(q, k, v, selected.unsqueeze(1), q_positions, k_positions)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The indexer's weights, replicated over TP (and the sinks a parent would have: none with MLA)."""
        state_dict = {f"indexer.{name}": param for name, param in self.indexer.named_parameters()}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {}, sharded_offsets)
