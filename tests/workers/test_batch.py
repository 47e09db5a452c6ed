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


def _row_by_row(batch, rows: list[int], pack: bool, tp: int) -> dict[str, list]:
    """What a micro-batch must hold, built one row at a time in plain Python: each row's real tokens (one block),
    laid end to end (packed, each sequence starting at its own position 0) or one per row right-padded to a multiple
    of TP, every label the next token of the same sequence, and each position whose next token is a real token
    mapped to that token's [row, column] cell of the batch."""
    tokens = [[int(t) for t, m in zip(batch.input_ids[r], batch.attention_mask[r]) if m] for r in rows]
    columns = [[c for c, m in enumerate(batch.attention_mask[r].tolist()) if m] for r in rows]
    width = batch.input_ids.shape[1]
    round_up = lambda n: -(-n // tp) * tp  # noqa: E731
    if pack:
        total = round_up(sum(map(len, tokens)))
        ids, labels, positions, sources, targets, offset = [0] * total, [0] * total, [0] * total, [], [], 0
        for n, seq in enumerate(tokens):
            for j, token in enumerate(seq):
                ids[offset + j], positions[offset + j] = token, j
                if j + 1 < len(seq):
                    labels[offset + j] = seq[j + 1]
                    sources.append(offset + j)
                    targets.append(n * width + columns[n][j + 1])
            offset += len(seq)
        return {"input_ids": [ids], "labels": [labels], "position_ids": [positions], "source_index": sources,
                "target_index": targets}
    padded = round_up(max(map(len, tokens)))
    ids, labels, sources, targets = [], [], [], []
    for n, seq in enumerate(tokens):
        ids.append(seq + [0] * (padded - len(seq)))
        labels.append(seq[1:] + [0] * (padded - len(seq) + 1))
        sources += [n * padded + j for j in range(len(seq) - 1)]
        targets += [n * width + c for c in columns[n][1:]]
    return {"input_ids": ids, "labels": labels, "position_ids": [list(range(padded))] * len(rows),
            "source_index": sources, "target_index": targets}


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_micro_batch_holds_each_rows_tokens_labels_and_way_back_as_built_row_by_row(pack, tp, monkeypatch):
    from megatron.core import parallel_state

    from rlmegatron.workers.batch import RolloutBatch

    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda *args, **kwargs: None)  # THD params
    generator = torch.Generator().manual_seed(tp + 2 * pack)
    for _ in range(40):
        rows, prompt, response = (int(torch.randint(1, high, (), generator=generator)) for high in (9, 6, 6))
        mask = torch.zeros(rows, prompt + response, dtype=torch.long)
        for r in range(rows):  # left-padded prompts of 1..prompt tokens, right-padded responses of 0..response
            start = int(torch.randint(0, prompt, (), generator=generator))
            mask[r, start : prompt + int(torch.randint(0, response + 1, (), generator=generator))] = 1
        batch = RolloutBatch(torch.randint(1, 50, mask.shape, generator=generator), mask, torch.ones(rows, response))
        count = int(torch.randint(1, rows + 1, (), generator=generator))
        chosen = sorted(torch.randperm(rows, generator=generator)[:count].tolist())
        built = build_micro_batch(batch, chosen, pack, tp)
        assert {name: getattr(built, name).tolist() for name in _row_by_row(batch, chosen, pack, tp)} == \
            _row_by_row(batch, chosen, pack, tp)
