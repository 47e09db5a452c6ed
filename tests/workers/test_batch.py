"""Micro-batch counts the interleaved pipeline accepts (pure functions, no ranks)."""
import dataclasses

import pytest
import torch

from rlmegatron.workers.batch import build_micro_batch, split_to_multiple, token_budget_micro_batches
from tests.workers.jobs import rollout_batch


def test_a_token_budget_split_is_cut_further_into_whole_pipeline_groups():
    lengths = [9, 7, 5, 4, 3, 2, 2]
    groups = token_budget_micro_batches(list(range(7)), lengths, max_token_len=12)
    assert len(groups) == 3  # what Megatron's interleaved schedule refuses at PP=2
    split = split_to_multiple(groups, lengths, 2)
    assert len(split) == 4
    assert sorted(i for g in split for i in g) == list(range(7))  # every sequence once
    assert max(sum(lengths[i] for i in g) for g in split) <= 12  # the budget still holds


def test_already_whole_groups_are_left_alone_and_too_few_sequences_say_so():
    assert split_to_multiple([[0, 1], [2]], [3, 3, 3], 2) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="multiple of 4 micro-batches"):
        split_to_multiple([[0, 1], [2]], [3, 3, 3], 4)


def test_a_micro_batch_is_packed_when_padding_would_add_more_than_a_quarter_of_its_tokens():
    from rlmegatron.workers.megatron_step import packing_pays

    assert not packing_pays([10, 11, 12, 13])  # 52 padded tokens for 46: +13%
    assert not packing_pays([4, 13, 13, 13])  # 52 for 43: +21%
    assert packing_pays([2, 3, 13])  # 39 for 18: +117%
    assert not packing_pays([12, 12]) and packing_pays([12, 12], length_multiple=16)  # 32 for 24: +33%


def test_a_micro_batch_moves_to_a_device_whole():
    """Every tensor the loss reads moves with the micro-batch, index tensors and per-token fields included (on the
    first GPU run an index left on the host failed the update); the meta device stands in for a GPU here."""
    batch = rollout_batch()
    batch.advantages = torch.randn(batch.response_mask.shape)
    moved = build_micro_batch(batch, [0, 2, 5], pack=False).to("meta")
    tensors = [value for field in dataclasses.fields(moved) if isinstance(value := getattr(moved, field.name),
                                                                         torch.Tensor)]
    fields = [value for field in dataclasses.fields(moved.response_fields)
              if (value := getattr(moved.response_fields, field.name)) is not None]
    assert len(tensors) == 5 and len(fields) >= 4
    assert all(t.device.type == "meta" for t in tensors + fields)
