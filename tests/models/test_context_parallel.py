"""Megatron's load-balanced context-parallel split, by hand (pure torch, no ranks)."""
import pytest
import torch

from rlmegatron.models.context_parallel import chunk_positions, gathered_positions


def test_each_rank_holds_chunk_r_and_its_mirror_and_the_ranks_cover_the_sequence_once():
    # 12 tokens over CP=3: 6 chunks of 2; rank r holds chunks r and 5 - r.
    assert chunk_positions(12, 3, 0).tolist() == [0, 1, 10, 11]
    assert chunk_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert chunk_positions(12, 3, 2).tolist() == [4, 5, 6, 7]
    assert gathered_positions(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert torch.equal(gathered_positions(12, 3).sort().values, torch.arange(12))


def test_a_length_that_2cp_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="cannot be split into 2×2"):
        chunk_positions(6, 2, 0)
