"""Modules the local (non-Transformer-Engine) layer spec uses in place of Megatron-Core's, on CPU and GPU alike.

`SDPACoreAttention` (separate k/v head dims, as MLA needs, packed sequences attended one by one, shared-prompt
micro-batches, and context parallelism),
`SequenceParallelTorchNorm` (a torch norm that allows sequence parallelism; `ZeroCenteredRMSNorm` its (1 + weight) kind) and
`DuplicatedLinear` (MLA's replicated down projections, as TE's 'duplicated' mode);
`enable_local_mla` lets Megatron's MLA take DuplicatedLinear for those projections;
`enable_packed_rope` applies unfused RoPE to a packed micro-batch in one gather instead of a loop over its sequences.
"""
from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint

from rlmegatron.models.context_parallel import chunk_positions, gathered_positions
from rlmegatron.runtime.cpu_compat import plain_torch

_LOCAL_MLA = False
_PACKED_ROPE = False
# The keyword arguments Megatron-Core 0.16's apply_rotary_pos_emb gives its THD function.
_THD_OPTIONS = {"rotary_interleaved", "multi_latent_attention", "mscale", "cp_group"}


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


def enable_packed_rope() -> None:
    """Megatron-Core's unfused RoPE for packed (THD) input, without its loop over the sequences (idempotent).

    Without Transformer Engine's fused kernel, Megatron splits the pack into its sequences, slices the rotary table
    for each (a `.item()` per sequence in one of its two cases: a device sync on GPU) and concatenates the slices:
    several small ops per sequence, per layer, for queries and keys, and their backward (benchmarks/RESULTS.md, "RoPE
    in one gather"). Here each token's row of the table is gathered at once and the rotation is Megatron's own
    `_apply_rotary_pos_emb_bshd`: the same rows in the same order, so the same values bit for bit. Only calls
    without context parallelism and with Megatron-Core 0.16's arguments are replaced; at CP > 1, or from a later
    Megatron-Core that passes other arguments (its own THD function may no longer loop), Megatron's function runs."""
    global _PACKED_ROPE
    if _PACKED_ROPE:
        return
    from megatron.core.models.common.embeddings import rope_utils

    megatrons = rope_utils._apply_rotary_pos_emb_thd

    @functools.wraps(megatrons)
    def in_one_gather(t, cu_seqlens, freqs, *args, **options):
        # Only the arguments Megatron-Core 0.16 passes are understood here; anything else (a later Megatron's
        # options, context parallelism) goes to Megatron's own function exactly as it came.
        cp_group = options.get("cp_group")
        if args or not options.keys() <= _THD_OPTIONS or cp_group is None or cp_group.size() != 1:
            return megatrons(t, cu_seqlens, freqs, *args, **options)
        with plain_torch():  # index arithmetic and Megatron's rotation, naming no device
            tokens = t.shape[0]
            if freqs.dim() >= 1 and freqs.size(0) == cu_seqlens[-1]:
                # A table with a row per token of the pack (shared prompts, M-RoPE): Megatron takes each sequence's rows
                # at its offset, which, the sequences lying back to back, are the rows from the first offset on.
                rows = freqs[cu_seqlens[0] : cu_seqlens[0] + tokens]
            else:
                # A table by position: each token's position in its own sequence.
                starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
                positions = torch.arange(tokens, device=t.device) - torch.repeat_interleave(
                    starts.to(t.device), lengths.to(t.device), output_size=tokens)
                rows = freqs[positions.to(freqs.device)]
            rotation = {name: value for name, value in options.items() if name != "cp_group"}
            return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), rows, **rotation).squeeze(1)

    # apply_rotary_pos_emb looks the THD function up in its module when it runs.
    rope_utils._apply_rotary_pos_emb_thd = in_one_gather
    _PACKED_ROPE = True


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention on torch SDPA; supports k and v head dims that differ (MLA).

    A packed (THD) micro-batch is attended sequence by sequence: sequences of similar length are batched into one
    right-padded SDPA call, so no mask over the whole pack is built and no work is spent across sequences. At CP>1
    each rank holds Megatron's load-balanced chunks of every sequence (models/context_parallel.py); K and V are
    all-gathered over the CP group, exact like ring attention at the memory of the whole sequence's K and V, and the
    causal mask follows each token's position in its sequence.
    """

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
        self.config = config
        kv_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # gpt-oss: every other layer attends to its last window_size[0] + 1 keys only, and each head has a learned
        # sink, a logit of its own in every softmax that takes part of the weight and adds nothing to the output.
        self.window = config.window_size[0] if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            # Split with the heads over TP, as Megatron's own core attention splits it.
            self.softmax_offset.tensor_model_parallel = True
            self.softmax_offset.partition_dim = 0
            self.softmax_offset.partition_stride = 1
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by the local core attention")
        self.cp_group = None
        if config.context_parallel_size > 1:
            own = getattr(pg_collection, "cp", None)
            self.cp_group = own if own is not None else parallel_state.get_context_parallel_group()

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
        cp, rank = (1, 0) if self.cp_group is None else (self.cp_group.size(), self.cp_group.rank())
        if cp > 1:  # backward reduce-scatters the K and V gradients back to the ranks that hold those tokens
            key, value = (gather_from_sequence_parallel_region(t, group=self.cp_group) for t in (key, value))
        # Below, this module's own torch code, which names no device: it runs without the CPU layer's rewrite of
        # every torch call (benchmarks/RESULTS.md, "The CPU layer's rewrite in the training step").
        with plain_torch():
            return self._attend(query, key, value, attention_mask, packed_seq_params, cp, rank)

    def _attend(self, query, key, value, attention_mask, packed_seq_params, cp: int, rank: int):
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, cp, rank)
        # Megatron layout [s, b, heads, dim] -> SDPA layout [b, heads, s, dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if cp == 1 and attention_mask is None:
            # Right-padded rows need no mask (no real token sees a pad): plain causal attention, which SDPA runs on its
            # flash or memory-efficient kernels; a boolean mask sends it to the math path at twice the work.
            out = self._sdpa(q, k, v, None)
        else:
            if cp > 1:
                q_pos = chunk_positions(k.size(2), cp, rank, q.device)
                k_pos = gathered_positions(k.size(2), cp, q.device)
            else:
                q_pos = k_pos = torch.arange(q.size(2), device=q.device)
            mask = q_pos[:, None] >= k_pos[None, :]
            if attention_mask is not None:
                mask = mask & ~attention_mask.bool()[..., q_pos[:, None], k_pos[None, :]]  # Megatron marks what to hide
            out = self._sdpa(q, k, v, mask, q_pos, k_pos)
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _packed(self, query, key, value, params, cp: int, rank: int):
        """THD [tokens, heads, dim] attention, each sequence on its own (see `_packed_plan`), or each prompt and
        response of a shared-prompt micro-batch (`_shared_prompt_plan`)."""
        groups = getattr(params, "prompt_groups", None)
        if groups is not None:
            plan = _shared_prompt_plan(groups, query.size(0), query.device)
        else:
            plan = _packed_plan(tuple(params.cu_seqlens_q.tolist()), query.size(0), cp, rank, query.device)
        outputs = []
        for bucket in plan.buckets:
            q, k, v = query[bucket.q_index], key[bucket.k_index], value[bucket.k_index]  # [n, len, heads, dim]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = self._sdpa(q, k, v, bucket.mask(k.size(2)), bucket.q_positions,
                             rows=(bucket.q_index, bucket.k_index)).transpose(1, 2)
            outputs.append(out.reshape(-1, *out.shape[2:])[bucket.q_valid])
        out = torch.cat(outputs)[plan.order]
        return out.reshape(out.size(0), 1, -1)

    def _sdpa(self, q, k, v, mask, q_positions=None, k_positions=None, rows=None):
        """Attention of q [b, heads, Lq, d] over k, v; `mask` [.., Lq, Lk] says which keys each query sees (None:
        causal, the queries being the keys); `q_positions` [.., Lq] and `k_positions` [Lk] are their positions in the
        sequence (None: 0, 1, ...), which a sliding window needs; `rows` ([n, Lq], [n, Lk]) the tokens of a packed
        micro-batch the queries and keys are (None: a padded batch's, in order), which a sparse subclass reads."""
        if self.window is not None or self.softmax_offset is not None:
            return self._masked(q, k, v, mask, q_positions, k_positions)
        # Grouped-query attention inside SDPA: K and V are not repeated to every query head first.
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=mask is None,
            scale=self.softmax_scale,
            enable_gqa=k.size(1) != q.size(1),
        )


    def _masked(self, q, k, v, mask, q_positions, k_positions):
        """Attention under an explicit mask, with gpt-oss's parts where the model has them: the sliding window as a
        mask, and each head's sink as a key of zeros (its logit, q.0, plus the sink's bias, is the sink) with a value
        of zeros (it adds nothing): SDPA's softmax over the keys and the sink is then the softmax gpt-oss defines, and
        its gradient reaches the sink through the bias."""
        lq, lk = q.size(-2), k.size(-2)
        if q_positions is None:
            q_positions = torch.arange(lq, device=q.device)
        if k_positions is None:
            k_positions = torch.arange(lk, device=q.device)
        # Masks and positions per span ([n, 1, Lq, Lk], [n, Lq]: packed buckets) or shared ([Lq, Lk], [Lq]).
        if mask is None:
            mask = q_positions[..., :, None] >= k_positions
        mask = mask.view(-1, 1, lq, lk)
        if self.window is not None:
            mask = mask & (q_positions[..., :, None] - k_positions <= self.window).view(-1, 1, lq, lk)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        if self.softmax_offset is not None:
            b, heads = q.size(0), q.size(1)
            bias = torch.cat([bias.expand(b, heads, lq, lk),
                              self.softmax_offset.to(q.dtype).view(1, heads, 1, 1).expand(b, heads, lq, 1)], dim=-1)
            k = torch.cat([k, k.new_zeros(*k.shape[:-2], 1, k.size(-1))], dim=-2)
            v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.size(-1))], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale,
            enable_gqa=k.size(1) != q.size(1))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The sinks (softmax_offset), split over TP with the heads; nothing else here is a weight."""
        state_dict = self.state_dict(prefix="", keep_vars=True) if self.softmax_offset is not None else {}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets)


@dataclass(frozen=True)
class _Bucket:
    q_index: torch.Tensor  # [n, Lq] local query rows of n spans, right-padded
    q_valid: torch.Tensor  # indices of the real ones among the n * Lq
    k_index: torch.Tensor  # [n, Lk] rows of the (gathered) keys in position order, right-padded
    q_positions: Optional[torch.Tensor]  # [n, Lq] each query's position among its keys, or None: plain causal

    def mask(self, keys: int) -> Optional[torch.Tensor]:
        """[n, 1, Lq, Lk]: each query sees the keys up to its position. Made per call, not kept with the cached plan:
        n x Lq x Lk booleans (100 MB for 64 responses of 1024 tokens after a 512-token prompt) for each of the
        plans the cache holds would stay on the GPU."""
        if self.q_positions is None:
            return None
        return self.q_positions[:, None, :, None] >= torch.arange(keys, device=self.q_positions.device)


@dataclass(frozen=True)
class _PackedPlan:
    buckets: tuple[_Bucket, ...]
    order: torch.Tensor  # the buckets' concatenated valid rows -> local token order


@dataclass(frozen=True)
class _Spans:
    """Runs of queries that each attend causally to one run of keys (a packed sequence, or a response after its shared
    prompt), flattened: span i's queries are q_rows[q_start[i] : q_start[i] + q_length[i]], their positions among its
    keys q_positions[...] alike, its keys k_rows[k_start[i] : k_start[i] + k_length[i]] in position order."""

    q_rows: torch.Tensor
    q_positions: torch.Tensor
    q_length: list[int]
    k_rows: torch.Tensor
    k_length: list[int]
    plain: list[bool]  # the queries are the keys, at positions 0, 1, ...: a causal mask does

    @staticmethod
    def of_ranges(starts: torch.Tensor, lengths: torch.Tensor, prefix_starts: torch.Tensor,
                  prefix_lengths: torch.Tensor) -> "_Spans":
        """Spans whose queries are the rows starts[i] + (0..lengths[i]-1) and whose keys are the prefix rows
        prefix_starts[i] + (0..prefix_lengths[i]-1) followed by the queries (built without a loop over spans)."""
        key_lengths = prefix_lengths + lengths
        q_span, q_offset = _ragged(lengths)
        k_span, k_offset = _ragged(key_lengths)
        prefix = prefix_lengths[k_span]
        k_rows = torch.where(k_offset < prefix, prefix_starts[k_span] + k_offset, starts[k_span] + k_offset - prefix)
        return _Spans(starts[q_span] + q_offset, prefix_lengths[q_span] + q_offset, lengths.tolist(), k_rows,
                      key_lengths.tolist(), (prefix_lengths == 0).tolist())


def _ragged(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the concatenation of runs of `lengths`: each element's run, and its offset in that run."""
    run = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return run, torch.arange(len(run)) - (lengths.cumsum(0) - lengths)[run]


# A bucket of spans runs as one right-padded SDPA call; a span joins the current bucket while the bucket's padded work
# (queries x keys) stays within 1/0.8² = 1.6x its real work. Spans are taken longest keys first.
_BUCKET_FILL = 0.8


def _bucketed(spans: _Spans, local_tokens: int, device) -> _PackedPlan:
    q_length, k_length = spans.q_length, spans.k_length
    q_lengths, k_lengths = torch.tensor(q_length), torch.tensor(k_length)
    q_start, k_start = q_lengths.cumsum(0) - q_lengths, k_lengths.cumsum(0) - k_lengths
    ranked = sorted((i for i in range(len(q_length)) if q_length[i]), key=lambda i: (-k_length[i], -q_length[i]))
    buckets, valid_rows, start = [], [], 0
    while start < len(ranked):
        keys, queries, work, end = k_length[ranked[start]], 0, 0, start
        while end < len(ranked):
            span = ranked[end]
            grown_queries, grown_work = max(queries, q_length[span]), work + q_length[span] * k_length[span]
            if end > start and (end - start + 1) * grown_queries * keys * _BUCKET_FILL**2 > grown_work:
                break
            queries, work, end = grown_queries, grown_work, end + 1
        members, start = torch.tensor(ranked[start:end]), end
        q_valid = torch.arange(queries) < q_lengths[members, None]
        q_at = (q_start[members, None] + torch.arange(queries)).clamp(max=max(len(spans.q_rows) - 1, 0))
        k_valid = torch.arange(keys) < k_lengths[members, None]
        k_at = (k_start[members, None] + torch.arange(keys)).clamp(max=max(len(spans.k_rows) - 1, 0))
        q_index = torch.where(q_valid, spans.q_rows[q_at], 0)
        k_index = torch.where(k_valid, spans.k_rows[k_at], 0)
        # Padding queries look at key 0 only, so no row of the softmax is empty (NaN); their outputs are dropped.
        q_positions = torch.where(q_valid, spans.q_positions[q_at], 0)
        # Right-padded spans whose queries are their keys need only the causal mask: no real query reaches a padding
        # key. Otherwise (CP chunks, responses after a prompt) each query sees the keys up to its position.
        plain = all(spans.plain[i] for i in members.tolist())
        valid = q_valid.flatten().nonzero().squeeze(1)
        valid_rows.append(q_index.flatten()[valid])
        buckets.append(_Bucket(q_index.to(device), valid.to(device), k_index.to(device),
                               None if plain else q_positions.to(device)))
    order = torch.empty(local_tokens, dtype=torch.long)
    order[torch.cat(valid_rows)] = torch.arange(local_tokens)
    return _PackedPlan(tuple(buckets), order.to(device))


@functools.lru_cache(maxsize=64)
def _packed_plan(boundaries: tuple[int, ...], local_tokens: int, cp: int, rank: int, device) -> _PackedPlan:
    """Index tensors that run a THD pack sequence by sequence (the same for every layer of a forward, so cached).

    `boundaries` are the global cu_seqlens; at CP>1 each sequence's local rows are its two chunks on this rank
    (models/context_parallel.py) and its keys come from every rank's rows in the all-gathered K and V.
    Tokens after the last boundary form a sequence of their own.
    """
    if boundaries[-1] < local_tokens * cp:
        boundaries = boundaries + (local_tokens * cp,)
    edges = torch.tensor(boundaries)
    lengths = edges[1:] - edges[:-1]
    if cp == 1:
        return _bucketed(_Spans.of_ranges(edges[:-1], lengths, edges[:-1], torch.zeros_like(lengths)), local_tokens,
                         device)
    rows, positions, keys = [], [], []
    for start, length in zip(boundaries[:-1], lengths.tolist()):
        first = start // cp
        rows.append(torch.arange(first, first + length // cp))
        key_rows = torch.empty(length, dtype=torch.long)
        key_rows[gathered_positions(length, cp)] = torch.cat([rows[-1] + r * local_tokens for r in range(cp)])
        keys.append(key_rows)
        positions.append(chunk_positions(length, cp, rank))
    spans = _Spans(torch.cat(rows), torch.cat(positions), [len(r) for r in rows], torch.cat(keys),
                   lengths.tolist(), [False] * len(rows))
    return _bucketed(spans, local_tokens, device)


@functools.lru_cache(maxsize=64)
def _shared_prompt_plan(groups: tuple, local_tokens: int, device) -> _PackedPlan:
    """Index tensors that run a shared-prompt micro-batch (models/shared_prompts.py): each prompt attends to itself,
    each response to its prompt and its own earlier tokens; tokens outside every group (rounding padding) form a
    sequence of their own."""
    prompts = [(start, length) for start, length, _ in groups]
    responses = [(start, length, prompt_start, prompt_length)
                 for prompt_start, prompt_length, members in groups for start, length in members]
    covered = max([start + length for start, length in prompts]
                  + [start + length for start, length, _, _ in responses], default=0)
    runs = [(start, length, 0, 0) for start, length in prompts] + responses + [(covered, local_tokens - covered, 0, 0)]
    starts, lengths, prefix_starts, prefix_lengths = torch.tensor(runs, dtype=torch.long).unbind(1)
    return _bucketed(_Spans.of_ranges(starts, lengths, prefix_starts, prefix_lengths), local_tokens, device)


class SequenceParallelTorchNorm:
    """torch LayerNorm/RMSNorm that, unlike WrappedTorchNorm, allows sequence parallelism.

    With sequence parallelism each TP rank normalises a slice of the sequence, so
    the norm's weight gradients are partial: marking them `sequence_parallel` makes
    Megatron's finalize_model_grads all-reduce them across the TP group.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm" and config.layernorm_zero_centered_gamma:
            norm = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization={config.normalization!r} is not supported on CPU")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaling by (1 + weight) (Megatron's layernorm_zero_centered_gamma; Qwen3-Next's and Qwen3.5's norms):
    the weight is stored as the checkpoints hold it, initialised to 0, so conversion and sync copy it unchanged. As
    transformers computes it: normalised and scaled in fp32, then cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        with plain_torch():
            normalised = torch.nn.functional.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
            return (normalised * (1.0 + self.weight.float())).to(x.dtype)


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
