"""rlmegatron/models/layers.py: RoPE over a packed micro-batch in one gather gives Megatron-Core's loop over its
sequences bit for bit, forward and backward, for a table by position and a table with a row per token."""
import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from rlmegatron.models.layers import enable_packed_rope


class OneRankGroup:
    def size(self):
        return 1

    def rank(self):
        return 0


def rotated(thd, t, cu_seqlens, freqs, **options):
    t = t.detach().clone().requires_grad_()
    out = thd(t, cu_seqlens, freqs, cp_group=OneRankGroup(), **options)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin())
    return out.detach(), t.grad


@pytest.mark.parametrize("per_token", [False, True], ids=["table-by-position", "row-per-token"])
@pytest.mark.parametrize("options", [{}, {"rotary_interleaved": True}, {"multi_latent_attention": True, "mscale": 0.7}],
                         ids=["plain", "interleaved", "mla-mscale"])
def test_packed_rope_in_one_gather_is_megatrons_loop_bit_for_bit(per_token, options):
    enable_packed_rope()
    ours = rope_utils._apply_rotary_pos_emb_thd
    megatrons = ours.__wrapped__  # Megatron's own, which ours replaced
    assert megatrons.__module__ == rope_utils.__name__
    enable_packed_rope()  # idempotent
    assert rope_utils._apply_rotary_pos_emb_thd is ours

    generator = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3, 7]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens, heads, dim = sum(lengths), 3, 8
    t = torch.randn(tokens, heads, dim, generator=generator)
    positions = tokens if per_token else max(lengths) + 4
    freqs = torch.randn(positions, 1, 1, dim, generator=generator)
    expected, expected_grad = rotated(megatrons, t, cu_seqlens, freqs, **options)
    got, got_grad = rotated(ours, t, cu_seqlens, freqs, **options)
    assert torch.equal(got, expected) and torch.equal(got_grad, expected_grad)
    # Not trivially equal: a shuffled table gives other values.
    shuffled, _ = rotated(ours, t, cu_seqlens, freqs.flip(0), **options)
    assert not torch.equal(shuffled, expected)


class TwoRankGroup(OneRankGroup):
    def size(self):
        return 2


def test_packed_rope_leaves_context_parallelism_and_other_arguments_to_megatron(monkeypatch):
    from rlmegatron.models import layers

    current = rope_utils._apply_rotary_pos_emb_thd
    megatrons = getattr(current, "__wrapped__", current)
    calls = []

    def spy(*args, **options):  # stands for Megatron's function: what reaches it, and its answer
        calls.append(options)
        return megatrons(*args, **options)

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", spy)  # both restored after the test
    monkeypatch.setattr(layers, "_PACKED_ROPE", False)
    enable_packed_rope()  # wraps the spy
    wrapped = rope_utils._apply_rotary_pos_emb_thd
    t, cu_seqlens, freqs = torch.randn(8, 2, 4), torch.tensor([0, 4, 8], dtype=torch.int32), torch.randn(8, 1, 1, 4)
    wrapped(t, cu_seqlens, freqs, cp_group=OneRankGroup(), mscale=0.5)
    assert calls == []  # handled in one gather
    two = TwoRankGroup()
    wrapped(t[:4], cu_seqlens, freqs, cp_group=two, mscale=0.5)  # this CP rank's half of each sequence
    assert calls == [{"cp_group": two, "mscale": 0.5}]
    one = OneRankGroup()
    with pytest.raises(TypeError, match="inverse"):  # 0.16's function has no such argument: it got it as given
        wrapped(t, cu_seqlens, freqs, cp_group=one, inverse=True)
    assert calls[-1] == {"cp_group": one, "inverse": True}


HEADS, KV_HEADS, DIM, WINDOW = 4, 2, 8, 3


def _attention(window: bool, sinks: bool):
    from megatron.core.transformer import TransformerConfig

    from rlmegatron.models.layers import SDPACoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, kv_channels=DIM, use_cpu_initialization=True,
                               attention_dropout=0.0, softmax_type="learnable" if sinks else "vanilla",
                               window_size=(WINDOW - 1, 0) if window else None, window_attn_skip_freq=[1])
    attention = SDPACoreAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")
    if sinks:
        with torch.no_grad():
            attention.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
    return attention


def _reference(q, k, v, sinks, window):
    """gpt-oss's attention as transformers' eager code writes it, for one sequence [len, heads, dim]."""
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM ** 0.5
    positions = torch.arange(q.size(0))
    allowed = positions[:, None] >= positions[None, :]
    if window:
        allowed &= positions[:, None] - positions[None, :] < WINDOW
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, q.size(0), 1)], dim=-1)
    weights = scores.softmax(-1)[..., : q.size(0)]
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("window, sinks", [(True, True), (True, False), (False, True)],
                         ids=["window-and-sinks", "window", "sinks"])
def test_sliding_window_and_sinks_are_gpt_oss_attention_padded_and_packed(window, sinks):
    """gpt-oss's attention in the local core attention: each query sees its last WINDOW keys, and each head's sink
    takes its share of the softmax; the same on a right-padded batch and on a pack of sequences, and the sinks'
    gradient is transformers'."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = _attention(window, sinks)
    lengths = (5, 9, 3)
    generator = torch.Generator().manual_seed(0)
    seqs = [[torch.randn(n, h, DIM, generator=generator) for h in (HEADS, KV_HEADS, KV_HEADS)] for n in lengths]
    sink = attention.softmax_offset.detach().clone().requires_grad_() if sinks else None
    expected = [_reference(q, k, v, sink, window) for q, k, v in seqs]
    # Packed (THD): [tokens, heads, dim], the sequences back to back.
    packed = [torch.cat([s[i] for s in seqs]) for i in range(3)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    out = attention(*packed, None, packed_seq_params=params).view(sum(lengths), HEADS, DIM)
    assert torch.allclose(out, torch.cat(expected), atol=1e-6)
    # Right-padded batch: [s, b, heads, dim]; the rows past each sequence's end are not compared.
    padded = [torch.zeros(9, len(lengths), h, DIM) for h in (HEADS, KV_HEADS, KV_HEADS)]
    for b, seq in enumerate(seqs):
        for tensor, part in zip(padded, seq):
            tensor[: part.size(0), b] = part
    out = attention(*padded, None).view(9, len(lengths), HEADS, DIM)
    for b, n in enumerate(lengths):
        assert torch.allclose(out[:n, b], expected[b], atol=1e-6)
    if sinks:
        torch.cat(expected).sum().backward()
        attention.zero_grad()
        attention(*packed, None, packed_seq_params=params).sum().backward()
        assert torch.allclose(attention.softmax_offset.grad, sink.grad, atol=1e-6) and sink.grad.abs().min() > 0
