"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, as a Megatron module that runs on CPU.

Megatron-Core 0.16.1's own `ssm.gated_delta_net.GatedDeltaNet` needs the `fla` Triton kernels and a CUDA device, and
refuses packed sequences; this one computes the gated delta rule in plain torch (chunked, exact in fp32), sequence by
sequence for a packed micro-batch. Its parameters are Megatron's (in_proj, conv1d, dt_bias, A_log, out_norm,
out_proj) in Megatron's layout, and so is its distributed checkpoint:

- TP splits the heads: rank r holds key heads r*nk/TP.. and the value heads they serve (value head j reads key head
  j // (nv/nk)), so the recurrence needs no communication. in_proj is column-parallel, each rank's rows
  [q_r; k_r; v_r; z_r; b_r; a_r]; the depthwise causal conv1d over [q; k; v] is split the same way, and so are the
  per-value-head dt_bias and A_log; out_proj is row-parallel.
- The output norm (over one value head) is shared by the heads every rank holds: its gradient is summed over TP,
  which Megatron does for a `sequence_parallel` weight, so TP > 1 requires sequence parallelism (which the MoE
  families that have this layer run at TP > 1 anyway).
- A right-padded micro-batch needs no mask (the recurrence is causal: padding after a sequence reaches nothing
  before it). A packed one is laid out as right-padded rows, one per sequence of cu_seqlens, and back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.ssm.gated_delta_net import _split_tensor_factory
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)

from rlmegatron.runtime.cpu_compat import plain_torch

CHUNK = 64  # tokens per chunk of the chunked recurrence: its within-chunk work is matrix products of CHUNK x CHUNK
L2_EPS = 1e-6  # the query/key L2 norm's epsilon, transformers' and fla's


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet mixer: [s, b, hidden] -> ([s, b, hidden], None), in a TransformerLayer's self_attention slot."""

    def __init__(self, config, submodules=None, layer_number: int | None = None, pg_collection=None, **_unused):
        super().__init__(config)
        self.tp_group = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
        tp = self.tp_group.size()
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        if nk % tp or nv % nk:
            raise ValueError(f"Gated DeltaNet: {nk} key heads over TP={tp}, {nv} value heads over {nk} key heads "
                             "do not divide")
        if tp > 1 and not config.sequence_parallel:
            raise ValueError("Gated DeltaNet at TP > 1 needs sequence parallelism (its output norm's gradient)")
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_heads, self.value_heads = nk // tp, nv // tp
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.split_sizes = [keys, keys, values, values, self.value_heads, self.value_heads]  # this rank's in_proj rows
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, tp * sum(self.split_sizes), config=config, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=False, is_expert=False, tp_group=self.tp_group)
        channels = 2 * keys + values
        self.conv1d = torch.nn.Conv1d(channels, channels, config.linear_conv_kernel_dim, groups=channels, bias=False,
                                      dtype=config.params_dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads, dtype=config.params_dtype))
        # transformers' and Megatron's initialisation: A uniform in [1, 16] (the decay rate's scale), stored as log A
        self.A_log = torch.nn.Parameter(torch.empty(self.value_heads, dtype=config.params_dtype).uniform_(1, 16).log())
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
        self.out_norm = torch.nn.RMSNorm(self.value_dim, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        self.out_norm.weight.sequence_parallel = config.sequence_parallel
        self.out_proj = RowParallelLinear(
            nv * self.value_dim, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=self.tp_group)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, inference_context=None, **_unused):
        if inference_context is not None:
            raise NotImplementedError("Gated DeltaNet keeps no inference cache here: generation runs in the engines")
        if attention_mask is not None:
            # The trainer's micro-batches are right-padded or packed, maskless (rank/roles/batch.py); a mask would
            # mean tokens hidden inside a sequence, which a recurrence cannot skip.
            raise NotImplementedError("Gated DeltaNet runs right-padded or packed sequences, without a mask")
        if packed_seq_params is not None and getattr(packed_seq_params, "prompt_groups", None) is not None:
            raise NotImplementedError("Gated DeltaNet does not run shared-prompt micro-batches "
                                      "(models.shared_prompts.shared_prompts_supported lays none out for it)")
        projected, _ = self.in_proj(hidden_states)  # [s, b, rows of this rank]
        with plain_torch():
            if packed_seq_params is None:
                mixed = self._mix(projected.transpose(0, 1)).transpose(0, 1)
            else:
                mixed = self._mix_packed(projected, packed_seq_params.cu_seqlens_q)
        return self.out_proj(mixed.contiguous())

    def _mix_packed(self, projected, cu_seqlens):
        """[T, 1, rows] of sequences back to back -> [T, 1, values]: each sequence a right-padded row of its own."""
        tokens = projected.size(0)
        edges = cu_seqlens.tolist()
        if edges[-1] < tokens:  # tokens past the last boundary form a sequence of their own
            edges.append(tokens)
        edges = torch.tensor(edges)
        lengths = edges[1:] - edges[:-1]
        offsets = torch.arange(int(lengths.max()))
        valid = offsets < lengths[:, None]
        index = (edges[:-1, None] + offsets).clamp(max=tokens - 1).to(projected.device)
        rows = projected[:, 0][index] * valid.to(projected.device, projected.dtype)[..., None]  # [n, L, rows]
        mixed = self._mix(rows)
        return mixed[valid.to(projected.device)].unsqueeze(1)

    def _mix(self, projected):
        """[b, s, rows] -> [b, s, values]: causal convolution, the gated delta rule and the gated output norm."""
        b, s, _ = projected.shape
        qkv, z, beta, alpha = torch.split(projected, [sum(self.split_sizes[:3]), *self.split_sizes[3:]], dim=-1)
        kernel = self.conv1d.weight.size(-1)
        qkv = F.silu(F.conv1d(F.pad(qkv.transpose(1, 2), (kernel - 1, 0)), self.conv1d.weight,
                              groups=qkv.size(-1))).transpose(1, 2)
        query, key, value = torch.split(qkv, self.split_sizes[:3], dim=-1)
        repeat = self.value_heads // self.key_heads
        query = _l2_normalised(query.reshape(b, s, self.key_heads, self.key_dim).float())
        key = _l2_normalised(key.reshape(b, s, self.key_heads, self.key_dim).float())
        query, key = (t.repeat_interleave(repeat, dim=2) for t in (query, key))
        value = value.reshape(b, s, self.value_heads, self.value_dim).float()
        decay = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())  # log of each step's decay
        out = gated_delta_rule(query * self.key_dim ** -0.5, key, value, decay, beta.float().sigmoid())
        gate = z.reshape(b, s, self.value_heads, self.value_dim)
        # As transformers' gated norm: normalised in fp32, cast, scaled by the weight, gated in fp32.
        normalised = F.rms_norm(out, (self.value_dim,), eps=self.out_norm.eps).to(projected.dtype)
        out = self.out_norm.weight * normalised * F.silu(gate.float())
        return out.to(projected.dtype).reshape(b, s, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron GatedDeltaNet's checkpoint layout: the TP-split tensors along dim 0, in_proj and conv1d as their
        q/k/v(/z/b/a) parts, so that a checkpoint loads at any TP (the parts' rows are per rank interleaved)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        common = dict(sharded_offsets=sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        state = make_sharded_tensors_for_checkpoint(
            {"A_log": self.A_log, "dt_bias": self.dt_bias, "conv1d.weight": self.conv1d.weight}, prefix,
            {"A_log": 0, "dt_bias": 0, "conv1d.weight": 0}, **common)
        state.update(self.in_proj.sharded_state_dict(f"{prefix}in_proj.", sharded_offsets, metadata))
        state.update(self.out_proj.sharded_state_dict(f"{prefix}out_proj.", sharded_offsets, metadata))
        state.update(sharded_state_dict_default(self.out_norm, f"{prefix}out_norm.", sharded_offsets, metadata,
                                                tp_group=self.tp_group))
        names = ["query", "key", "value", "z", "beta", "alpha"]
        state[f"{prefix}in_proj.weight"] = _split_tensor_factory(state[f"{prefix}in_proj.weight"], self.split_sizes,
                                                                 names, 0)
        state[f"{prefix}conv1d.weight"] = _split_tensor_factory(state[f"{prefix}conv1d.weight"],
                                                                self.split_sizes[:3], names[:3], 0)
        return state


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as transformers and fla normalise queries and keys."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rule(query, key, value, decay, beta, chunk: int = CHUNK):
    """The gated delta rule over [b, s, heads, dim] queries, keys (normalised; queries scaled) and values, with
    per-step log decays and write strengths [b, s, heads], from a zero state; returns [b, s, heads, value dim].

    Per step: S <- exp(decay) S; S <- S + k beta (v - S^T k)^T; out = S^T q. In chunks of `chunk` steps, the steps'
    writes u_i = beta_i (v_i - S_{i-1}^T k_i) of one chunk solve one unit lower-triangular system (every write depends
    on the earlier writes of its chunk through k_i . k_j and the decay between them), and the state is carried from
    chunk to chunk: matrix products instead of a loop over the tokens, the same values to fp32 rounding.
    """
    b, s, heads, _ = key.shape
    # As many chunks as `chunk` steps need, of equal size: a short sequence (an RL response, a prompt) is one chunk of
    # its own length instead of one padded to `chunk` (5x faster at 10 steps on CPU; the same values to rounding).
    count = -(-s // chunk)
    chunk = -(-s // count)
    padded = count * chunk
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, padded - s)).transpose(1, 2).unflatten(2, (-1, chunk))
               for t in (query, key, value))  # [b, heads, chunks, chunk, dim]
    g, w = (F.pad(t, (0, 0, 0, padded - s)).transpose(1, 2).unflatten(2, (-1, chunk)) for t in (decay, beta))
    cumulative = g.cumsum(-1)  # log of the decay from the chunk's start through each step
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # between[i, j]: the decay from step j to step i of a chunk (j <= i); 0 above the diagonal
    between = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_written = k * w[..., None]
    system = ((k_written @ k.transpose(-1, -2)) * between).tril(-1)
    identity = torch.eye(chunk, dtype=q.dtype, device=q.device)
    # The writes are U = W_v - W_s S (W_s reads the state the chunk starts from), solved once for every chunk.
    written_values = torch.linalg.solve_triangular(identity + system, v * w[..., None], upper=False,
                                                   unitriangular=True)
    state_reads = torch.linalg.solve_triangular(identity + system, k_written * cumulative.exp()[..., None],
                                                upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * between  # each query's reads of its chunk's writes, decayed
    q_from_start = q * cumulative.exp()[..., None]
    to_end = (cumulative[..., -1:] - cumulative).exp()[..., None]
    k_to_end = k * to_end
    chunk_decay = cumulative[..., -1].exp()[..., None, None]
    state = q.new_zeros(b, heads, k.size(-1), v.size(-1))
    outputs = []
    for n in range(padded // chunk):
        writes = written_values[:, :, n] - state_reads[:, :, n] @ state
        outputs.append(q_from_start[:, :, n] @ state + within[:, :, n] @ writes)
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ writes
    return torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :s].transpose(1, 2)
