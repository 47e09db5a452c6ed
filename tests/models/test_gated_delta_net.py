"""Gated DeltaNet (models/gated_delta_net.py) against transformers' Qwen3.5 layer (its torch fallback): outputs and
gradients of a right-padded batch across two recurrence chunks, a packed micro-batch whose sequences do not see each
other, and TP=2 with sequence parallelism (gloo) giving TP=1's outputs and gradients."""
from __future__ import annotations

import torch

from rlmegatron.transport.local_ranks import run_ranks

HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, KERNEL = 32, 2, 4, 8, 4
LENGTHS = (70, 30)  # 70 crosses the 64-token chunk of the recurrence


def _hf_layer():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, num_hidden_layers=1, linear_num_key_heads=KEY_HEADS,
                                  linear_num_value_heads=VALUE_HEADS, linear_key_head_dim=HEAD_DIM,
                                  linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=KERNEL)
    torch.manual_seed(0)
    layer = Qwen3_5MoeGatedDeltaNet(config, 0)
    with torch.no_grad():
        for param in layer.parameters():  # all random, the norm and decay vectors too
            param.copy_(torch.randn_like(param) * (0.3 if param.dim() > 1 else 0.5) + (1.0 if param.dim() == 1 else 0))
    return layer


def _inputs():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(len(LENGTHS), max(LENGTHS), HIDDEN, generator=generator)  # padding too: nothing may read it
    upstream = torch.randn(len(LENGTHS), max(LENGTHS), HIDDEN, generator=generator)
    for row, length in enumerate(LENGTHS):
        upstream[row, length:] = 0  # the loss reads no padding position's output
    return x, upstream


def _reference():
    """transformers' outputs and input gradients, each sequence on its own (its real tokens only)."""
    layer = _hf_layer()
    x, upstream = _inputs()
    outputs, grads = [], []
    for row, length in enumerate(LENGTHS):
        seq = x[row:row + 1, :length].clone().requires_grad_()
        out = layer(seq)
        (out * upstream[row:row + 1, :length]).sum().backward()
        outputs.append(out.detach()[0])
        grads.append(seq.grad[0])
    return outputs, grads, {name: p.grad for name, p in layer.named_parameters()}


def _shards(hf: dict, tp: int) -> list[dict]:
    """Per TP rank, our layer's parameters from transformers' tensors (parameters or their gradients), by the
    Qwen3.5-MoE family's sources: each source's TP chunk in turn where Megatron concatenates them."""
    from rlmegatron.models.families.base import LinearAttention, Rows, Source
    from rlmegatron.models.families.qwen3_5_moe import FAMILY

    linear = LinearAttention(KEY_HEADS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, KERNEL, (True,))
    channels, keys = linear.conv_channels, KEY_HEADS * HEAD_DIM
    conv = [Source("conv1d.weight", rows=Rows(1, channels, start, rows))
            for start, rows in ((0, keys), (keys, keys), (2 * keys, channels - 2 * keys))]

    def concat(sources, rank):
        return torch.cat([s.select(hf[s.key]).chunk(tp)[rank] for s in sources])

    return [{"in_proj.weight": concat(FAMILY.projection_sources("", linear), rank), "conv1d.weight": concat(conv, rank),
             "dt_bias": hf["dt_bias"].chunk(tp)[rank], "A_log": hf["A_log"].chunk(tp)[rank],
             "out_norm.weight": hf["norm.weight"], "out_proj.weight": hf["out_proj.weight"].chunk(tp, dim=1)[rank]}
            for rank in range(tp)]


def gdn_jobs() -> dict:
    """On each of 2 ranks, TP=1 (the ranks then data-parallel) and TP=2, padded and packed: one process group."""
    return {(tp, packed): gdn_job(tp, packed) for tp in (1, 2) for packed in (False, True)}


def gdn_job(tp: int, packed: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    from megatron.core.transformer import TransformerConfig

    from rlmegatron.models.gated_delta_net import GatedDeltaNet
    from rlmegatron.runtime import ParallelLayout
    from rlmegatron.runtime.distributed import init_model_parallel

    init_model_parallel(ParallelLayout(tp=tp, sequence_parallel=tp > 1))
    rank = ps.get_tensor_model_parallel_rank()
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=tp,
                               sequence_parallel=tp > 1, use_cpu_initialization=True, layernorm_epsilon=1e-6,
                               linear_conv_kernel_dim=KERNEL, linear_key_head_dim=HEAD_DIM,
                               linear_value_head_dim=HEAD_DIM, linear_num_key_heads=KEY_HEADS,
                               linear_num_value_heads=VALUE_HEADS)
    ours = GatedDeltaNet(config, layer_number=1)
    with torch.no_grad():
        for name, value in _shards({name: p.detach() for name, p in _hf_layer().named_parameters()}, tp)[rank].items():
            ours.get_parameter(name).copy_(value)
    x, upstream = _inputs()
    if packed:  # the sequences back to back, [tokens, 1, hidden]
        full = torch.cat([x[row, :length] for row, length in enumerate(LENGTHS)]).unsqueeze(1)
        up = torch.cat([upstream[row, :length] for row, length in enumerate(LENGTHS)]).unsqueeze(1)
        cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                                 max_seqlen_kv=max(LENGTHS))
    else:  # right-padded rows, [s, b, hidden]
        full, up, params = x.transpose(0, 1), upstream.transpose(0, 1), None
    local = full.chunk(tp)[rank].clone().requires_grad_()  # sequence parallelism: this rank's share of the tokens
    out, _ = ours(local, None, packed_seq_params=params)
    (out * up.chunk(tp)[rank]).sum().backward()
    gather = (lambda t: gather_from_sequence_parallel_region(t)) if tp > 1 else (lambda t: t)
    return {"out": gather(out.detach()), "x_grad": gather(local.grad),
            "grads": {name: p.grad for name, p in ours.named_parameters()}}


def _per_sequence(tensor, packed: bool):
    """Each sequence's real tokens out of a [s, b, hidden] or packed [tokens, 1, hidden] result."""
    if packed:
        return list(tensor[:, 0].split(list(LENGTHS)))
    return [tensor[:length, row] for row, length in enumerate(LENGTHS)]


# Largest difference over the reference's largest magnitude: fp32 rounding of the chunked triangular solves
# (transformers' chunks as ours) is ~3e-6 here, a wrong head, gate or sequence boundary is O(1).
TOLERANCE = 2e-5


def _off(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_gated_delta_net_is_transformers_padded_packed_and_at_tp2():
    outputs, x_grads, hf_grads = _reference()
    results = run_ranks(gdn_jobs, 2)
    for packed in (False, True):
        for tp in (1, 2):
            ranks = [result[tp, packed] for result in results][:tp]  # at TP=1 the two ranks compute the same
            for rank in ranks:
                for got, want in zip(_per_sequence(rank["out"], packed), outputs):
                    assert _off(got, want) < TOLERANCE, (tp, packed, _off(got, want))
                for got, want in zip(_per_sequence(rank["x_grad"], packed), x_grads):
                    assert _off(got, want) < TOLERANCE, (tp, packed, _off(got, want))
            # Each rank's gradients are its shards of transformers'; the output norm's, shared by every head, summed
            # over the ranks (what Megatron's finalize_model_grads does for a sequence-parallel weight).
            expected = _shards(hf_grads, tp)
            for rank, want in zip(ranks, expected):
                for name, value in want.items():
                    got = rank["grads"][name] if name != "out_norm.weight" else sum(
                        r["grads"][name] for r in ranks)
                    assert _off(got, value) < TOLERANCE, (tp, packed, name, _off(got, value))
