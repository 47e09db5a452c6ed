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
