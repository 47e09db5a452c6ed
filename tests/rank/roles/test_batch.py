"""Micro-batch counts the interleaved pipeline accepts (pure functions, no ranks)."""
import dataclasses

import pytest
import torch

from rlmegatron.rank.roles.batch import build_micro_batch, split_to_multiple, token_budget_micro_batches
from tests.rank.roles.jobs import rollout_batch


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
    from rlmegatron.rank.roles.megatron_step import packing_pays

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
    assert len(tensors) == 7 and len(fields) >= 4  # token_cells too (routing replay); no routing record here
    assert all(t.device.type == "meta" for t in tensors + fields)


def _row_by_row(batch, rows: list[int], pack: bool, tp: int) -> dict[str, list]:
    """What a micro-batch must hold, built one row at a time in plain Python: each row's real tokens (one block),
    laid end to end (packed, each sequence starting at its own position 0) or one per row right-padded to a multiple
    of TP, every label the next token of the same sequence, and each position whose next token is a response token
    mapped to that token's [row, column] cell of the batch, with that token as the target's label."""
    tokens = [[int(t) for t, m in zip(batch.input_ids[r], batch.attention_mask[r]) if m] for r in rows]
    columns = [[c for c, m in enumerate(batch.attention_mask[r].tolist()) if m] for r in rows]
    width = batch.input_ids.shape[1]
    first_response_column = width - batch.response_length
    round_up = lambda n: -(-n // tp) * tp  # noqa: E731
    if pack:
        total = round_up(sum(map(len, tokens)))
        ids, labels, positions, sources, targets, target_labels, offset = [0] * total, [0] * total, [0] * total, [], \
            [], [], 0
        for n, seq in enumerate(tokens):
            for j, token in enumerate(seq):
                ids[offset + j], positions[offset + j] = token, j
                if j + 1 < len(seq):
                    labels[offset + j] = seq[j + 1]
                    if columns[n][j + 1] >= first_response_column:
                        sources.append(offset + j)
                        targets.append(n * width + columns[n][j + 1])
                        target_labels.append(seq[j + 1])
            offset += len(seq)
        return {"input_ids": [ids], "labels": [labels], "position_ids": [positions], "source_index": sources,
                "target_index": targets, "target_labels": target_labels}
    padded = round_up(max(map(len, tokens)))
    ids, labels, sources, targets, target_labels = [], [], [], [], []
    for n, seq in enumerate(tokens):
        ids.append(seq + [0] * (padded - len(seq)))
        labels.append(seq[1:] + [0] * (padded - len(seq) + 1))
        for j in range(len(seq) - 1):
            if columns[n][j + 1] >= first_response_column:
                sources.append(n * padded + j)
                targets.append(n * width + columns[n][j + 1])
                target_labels.append(seq[j + 1])
    return {"input_ids": ids, "labels": labels, "position_ids": [list(range(padded))] * len(rows),
            "source_index": sources, "target_index": targets, "target_labels": target_labels}


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_micro_batch_holds_each_rows_tokens_labels_and_way_back_as_built_row_by_row(pack, tp, monkeypatch):
    from megatron.core import parallel_state

    from rlmegatron.rank.roles.batch import RolloutBatch

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


def _grouped_batch(generator, rows: int, prompt: int, response: int, groups: int):
    """Rows that draw their prompt (1..prompt tokens, left-padded) from `groups` distinct ones, in random order, with
    right-padded responses of 0..response tokens."""
    from rlmegatron.rank.roles.batch import RolloutBatch

    prompts = [torch.randint(1, 50, (int(torch.randint(1, prompt + 1, (), generator=generator)),), generator=generator)
               for _ in range(groups)]
    input_ids = torch.zeros(rows, prompt + response, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r in range(rows):
        tokens = prompts[int(torch.randint(0, groups, (), generator=generator))]
        size = int(torch.randint(0, response + 1, (), generator=generator))
        input_ids[r, prompt - len(tokens) : prompt] = tokens
        input_ids[r, prompt : prompt + size] = torch.randint(1, 50, (size,), generator=generator)
        mask[r, prompt - len(tokens) : prompt + size] = 1
    return RolloutBatch(input_ids, mask, torch.ones(rows, response))


def _shared_row_by_row(batch, rows: list[int], tp: int) -> dict:
    """What a shared-prompt micro-batch must hold, built in plain Python: each distinct prompt of `rows` once (in the
    order of their prompt columns, padding as -1, compared as lists), each followed by the responses of its rows in
    the given order, each response at the positions that follow its prompt; every response token predicted by the
    token before it in that layout (the prompt's last for a first token, none if the prompt is empty)."""
    width, response = batch.input_ids.shape[1], batch.response_length
    prompt_columns = width - response
    key = {r: [int(t) if m else -1 for t, m in zip(batch.input_ids[r, :prompt_columns],
                                                    batch.attention_mask[r, :prompt_columns])] for r in rows}
    ids, positions, sources, targets, target_labels, groups = [], [], [], [], [], []
    for group_key in sorted({tuple(k) for k in key.values()}):
        prompt = [t for t in group_key if t >= 0]
        start = len(ids)
        ids += prompt
        positions += range(len(prompt))
        members = []
        for n, r in enumerate(rows):
            if tuple(key[r]) != group_key:
                continue
            cells = [c for c in range(prompt_columns, width) if batch.attention_mask[r, c]]
            if cells:
                members.append((len(ids), len(cells)))
            for k, c in enumerate(cells):
                if k or prompt:  # the token before: this response's previous one, just laid out, or the prompt's last
                    sources.append(len(ids) - 1 if k else start + len(prompt) - 1)
                    targets.append(n * width + c)
                    target_labels.append(int(batch.input_ids[r, c]))
                ids.append(int(batch.input_ids[r, c]))
                positions.append(len(prompt) + k)
        groups.append((start, len(prompt), tuple(members)))
    padding = -(-len(ids) // tp) * tp - len(ids)
    return {"input_ids": [ids + [0] * padding], "position_ids": [positions + [0] * padding], "source_index": sources,
            "target_index": targets, "target_labels": target_labels, "groups": tuple(groups)}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_shared_prompt_micro_batch_lays_each_prompt_out_once_as_built_row_by_row(tp, monkeypatch):
    from megatron.core import parallel_state

    from rlmegatron.rank.roles.batch import build_shared_prompt_micro_batch, prompt_groups

    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda *args, **kwargs: None)  # THD params
    generator = torch.Generator().manual_seed(10 + tp)
    shared_somewhere = 0
    for _ in range(40):
        rows, prompt, response, groups = (int(torch.randint(1, high, (), generator=generator))
                                          for high in (12, 6, 5, 4))
        batch = _grouped_batch(generator, rows, prompt, response, groups)
        count = int(torch.randint(1, rows + 1, (), generator=generator))
        chosen = torch.randperm(rows, generator=generator)[:count].tolist()  # any order: it is kept within a group
        built = build_shared_prompt_micro_batch(batch, chosen, tp)
        expected = _shared_row_by_row(batch, chosen, tp)
        assert built.packed_seq_params.prompt_groups == expected["groups"]
        assert built.input_ids.tolist() == expected["input_ids"]
        assert built.position_ids.tolist() == expected["position_ids"]
        triples = zip(built.target_index.tolist(), built.source_index.tolist(), built.target_labels.tolist())
        assert sorted(triples) == sorted(zip(expected["target_index"], expected["source_index"],
                                             expected["target_labels"]))  # one order of the targets is as good
        assert built.packed_seq_params.cu_seqlens_q.tolist() == [0, built.input_ids.shape[1]]
        shared_somewhere += built.input_ids.shape[1] < int(batch.attention_mask[chosen].sum())
        # The batch's groups handed in (as shard_micro_batches does) give the same micro-batch.
        handed = build_shared_prompt_micro_batch(batch, chosen, tp, prompt_groups(
            batch.input_ids, batch.attention_mask, batch.response_length))
        assert handed.packed_seq_params.prompt_groups == built.packed_seq_params.prompt_groups
        assert all(torch.equal(getattr(handed, name), getattr(built, name))
                   for name in ("input_ids", "position_ids", "source_index", "target_index", "target_labels"))
    assert shared_somewhere > 10  # the cases exercise groups of several rows, not only one row per prompt
