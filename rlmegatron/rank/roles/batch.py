"""The workers' typed batch, token-balanced DP partitioning, token-budget micro-batches and sequence packing."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlmegatron.models.context_parallel import chunk_positions, gather_tokens


@dataclass
class RolloutBatch:
    """Sequences of one step, as the driver hands them to every rank of a worker group.

    ``input_ids``/``attention_mask`` are [B, L]: prompt then response, each row's real tokens one
    contiguous block (left and/or right padding). The responses are the last R = response_mask.shape[1]
    columns. Every per-token field below is [B, R] and aligned with ``response_mask``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    rollout_is_weights: Optional[torch.Tensor] = None
    """Rollout correction's importance weights (algorithms.rollout_correction), when the spec asks for them."""
    routed_experts: Optional[torch.Tensor] = None
    """MoE routing replay's record: [B, L, MoE layers, top-k] int16 expert ids over the token columns, -1 where a
    token has none (models/routing_replay.py)."""
    advantages: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def select(self, indices: torch.Tensor | list[int]) -> "RolloutBatch":
        """The rows `indices`, every field sliced alike."""
        index = torch.as_tensor(indices, dtype=torch.long)
        return RolloutBatch(
            **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
               for f in dataclasses.fields(self)}
        )

    def sequence_lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(dim=-1)

    def to(self, device) -> "RolloutBatch":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if getattr(self, f.name) is not None})


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Split indices into `parts` groups of near-equal total length (greedy, longest first); each group sorted."""
    if len(lengths) < parts:
        raise ValueError(f"{len(lengths)} sequences cannot be spread over {parts} data-parallel ranks")
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    counts = [0] * parts
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        # Fewest tokens first, then fewest sequences, so no rank is left empty.
        target = min(range(parts), key=lambda p: (counts[p] > 0, totals[p], counts[p]))
        groups[target].append(index)
        totals[target] += lengths[index]
        counts[target] += 1
    return [sorted(group) for group in groups]


def token_budget_micro_batches(indices: list[int], lengths: list[int], max_token_len: int) -> list[list[int]]:
    """Dynamic batch size: pack sequences, longest first, into micro-batches of at most `max_token_len` tokens.

    First-fit decreasing; a sequence longer than the budget is an error rather than a silent
    over-budget micro-batch.
    """
    bins: list[list[int]] = []
    bin_tokens: list[int] = []
    for index in sorted(indices, key=lambda i: -lengths[i]):
        if lengths[index] > max_token_len:
            raise ValueError(f"a sequence of {lengths[index]} tokens exceeds max_token_len={max_token_len}")
        for b, used in enumerate(bin_tokens):
            if used + lengths[index] <= max_token_len:
                bins[b].append(index)
                bin_tokens[b] += lengths[index]
                break
        else:
            bins.append([index])
            bin_tokens.append(lengths[index])
    return bins


def fixed_micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def split_largest(groups: list[list[int]], lengths: list[int], enough: Callable[[int], bool]) -> list[list[int]]:
    """Split the micro-batches with the most tokens in two until `enough(their count)`, or until each holds one
    sequence. Splitting only shrinks micro-batches, so a token budget still holds."""
    groups = [list(group) for group in groups]
    while not enough(len(groups)):
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            break
        largest = max(splittable, key=lambda g: sum(lengths[i] for i in g))
        at = groups.index(largest)
        groups[at : at + 1] = [largest[: len(largest) // 2], largest[len(largest) // 2 :]]
    return groups


def split_to_multiple(groups: list[list[int]], lengths: list[int], multiple: int) -> list[list[int]]:
    """Split the micro-batches with the most tokens until their count is a multiple of `multiple`.

    Megatron's interleaved (VPP) schedule takes micro-batches in groups of PP and refuses a partial group; the loss
    normalisation counts micro-batches after the split.
    """
    groups = split_largest(groups, lengths, lambda count: count % multiple == 0)
    if len(groups) % multiple:
        raise ValueError(f"the interleaved pipeline needs a multiple of {multiple} micro-batches per data-parallel "
                         f"rank, and {len(groups)} sequences cannot make one; give each rank more sequences")
    return groups


@dataclass
class MicroBatch:
    """Model inputs for some rows of a RolloutBatch, unpadded, and the way back to the [rows, R] response grid.

    The model emits one value per input position p (log-prob of the next token, or a value
    estimate). Each response token is a target: ``target_index`` is its flat [len(rows), L] cell,
    ``target_labels`` the token, and ``source_index`` the flat input position that predicts it (the
    position before it in its sequence; in a shared-prompt micro-batch the prompt's last position
    predicts the first token of each of its responses, so it appears once per response). At CP>1 the
    inputs are this rank's load-balanced chunks of each sequence (rlmegatron/models/context_parallel.py),
    ``context_order`` places the CP ranks' gathered outputs back in sequence order, and ``labels`` holds
    each input position's next token (None in a shared-prompt micro-batch, where it is not one token).
    A micro-batch with no ``rows`` is a filler (``filler_micro_batch``): it runs the model and nothing reads it.
    """

    rows: list[int]
    input_ids: torch.Tensor  # [1, T] packed or [n, T] right-padded; T/CP tokens of each at CP>1
    position_ids: torch.Tensor
    labels: Optional[torch.Tensor]
    packed_seq_params: object  # megatron PackedSeqParams (THD) or None
    source_index: torch.Tensor
    target_index: torch.Tensor
    target_labels: torch.Tensor
    batch_columns: int
    response_length: int
    response_fields: RolloutBatch  # the rows' own per-token fields ([n, R]) for the loss
    token_cells: Optional[torch.Tensor] = None  # [n, T]: each input position's batch cell, row * L + column; -1: none
    routed_experts: Optional[torch.Tensor] = None  # [n, T, MoE layers, k]: the record's experts per input position
    context_order: Optional[torch.Tensor] = None  # [T]: the sequence position of each gathered column (CP>1)
    context_group: object = None  # the CP process group (CP>1)

    def to(self, device) -> "MicroBatch":
        """Every tensor on `device`, moved once per micro-batch so the loss's index and field reads stay there."""
        tensors = ("input_ids", "position_ids", "labels", "source_index", "target_index", "target_labels",
                   "token_cells", "routed_experts", "context_order")
        moved = {name: getattr(self, name).to(device) for name in tensors if getattr(self, name) is not None}
        return dataclasses.replace(self, response_fields=self.response_fields.to(device), **moved)

    def to_response_grid(self, per_position: torch.Tensor) -> torch.Tensor:
        """Per-input-position values (model grid) -> [n, R] aligned with response_mask (differentiable).

        At CP>1 the per-token values of every CP rank are gathered first (never the logits they came from)."""
        if self.context_order is not None:
            per_position = gather_tokens(per_position, self.context_order, self.context_group)
        return self.targets_to_grid(per_position.reshape(-1)[self.source_index])

    def targets_to_grid(self, per_target: torch.Tensor) -> torch.Tensor:
        """One value per target (in ``target_index`` order) -> [n, R] aligned with response_mask (differentiable)."""
        grid = per_target.new_zeros(len(self.rows) * self.batch_columns).index_copy(0, self.target_index, per_target)
        return grid.view(len(self.rows), self.batch_columns)[:, -self.response_length :]


def routing_at(batch: RolloutBatch, token_cells: torch.Tensor) -> Optional[torch.Tensor]:
    """The batch's routing record at the cells `token_cells` names ([n, T] -> [n, T, MoE layers, k]); -1 (route
    freely) where a position has no cell; None when the batch has no record."""
    if batch.routed_experts is None:
        return None
    record = batch.routed_experts.reshape(-1, *batch.routed_experts.shape[2:])
    at = record[token_cells.clamp(min=0)]
    return at.masked_fill_((token_cells < 0)[..., None, None], -1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_micro_batch(batch: RolloutBatch, rows: list[int], pack: bool, tp: int = 1, cp: int = 1,
                      cp_rank: int = 0) -> MicroBatch:
    """Unpad `rows` of `batch`: one THD-packed row (pack=True) or right-padded rows, split over `cp` ranks.

    Sequence parallelism splits the tokens over TP ranks, so the length (packed: the total) rounds up to a multiple
    of TP. At CP>1 each sequence (packed: each one, padded at its end) rounds up to a multiple of 2×CP for the
    load-balanced chunks, and the length or total to 2×CP×TP; rank `cp_rank` keeps its chunks of each.
    """
    columns = batch.input_ids.shape[1]
    # Whole-tensor indexing, not a loop over rows: per-row slicing was a tenth of the update (benchmarks/RESULTS.md, "Measured reasons in the code").
    index = torch.as_tensor(rows, dtype=torch.long)
    mask = batch.attention_mask[index].bool()
    lengths_t = mask.sum(dim=1)
    starts = mask.int().argmax(dim=1)  # each row's real tokens are one contiguous block
    lengths = lengths_t.tolist()
    sequence_multiple = 2 * cp if cp > 1 else 1
    widest = max(lengths)
    offsets_in_row = torch.arange(widest)
    # tokens[n, j]: the j-th real token of row n (0 past its end); next_valid[n, j]: token j+1 is in the sequence.
    source_columns = (starts[:, None] + offsets_in_row).clamp(max=columns - 1)
    tokens = torch.where(offsets_in_row < lengths_t[:, None], batch.input_ids[index].gather(1, source_columns), 0)
    next_valid = offsets_in_row < (lengths_t - 1)[:, None]
    next_tokens = torch.where(next_valid, tokens.roll(-1, dims=1), 0)
    in_sequence = offsets_in_row < lengths_t[:, None]
    cells = torch.where(in_sequence, index[:, None] * columns + source_columns, -1)
    # (n, j) of every position whose next token is a response token of the same sequence, row by row: the model's
    # outputs over the prompt predict nothing the losses read.
    pairs = (next_valid & (source_columns >= columns - batch.response_length - 1)).nonzero()
    targets = pairs[:, 0] * columns + source_columns[pairs[:, 0], pairs[:, 1]] + 1
    target_labels = next_tokens[pairs[:, 0], pairs[:, 1]]

    if pack:
        spans = [_round_up(length, sequence_multiple) for length in lengths]
        total = _round_up(sum(spans), sequence_multiple * tp)
        starts_packed = torch.tensor([0, *spans[:-1]]).cumsum(0)
        real = offsets_in_row < lengths_t[:, None]
        at = (starts_packed[:, None] + offsets_in_row)[real]
        input_ids = torch.zeros(1, total, dtype=batch.input_ids.dtype)
        input_ids[0, at] = tokens[real].to(input_ids.dtype)
        labels = torch.zeros(1, total, dtype=batch.input_ids.dtype)
        labels[0, at] = next_tokens[real].to(labels.dtype)
        token_cells = torch.full((1, total), -1, dtype=torch.long)
        token_cells[0, at] = cells[real]
        # Positions count through each sequence's rounding padding too; the final rounding block stays at 0.
        sequences_end = sum(spans)
        span_positions = torch.arange(max(spans))
        in_span = span_positions < torch.tensor(spans)[:, None]
        position_ids = torch.zeros(1, total, dtype=torch.long)
        position_ids[0, (starts_packed[:, None] + span_positions)[in_span]] = span_positions.expand_as(in_span)[in_span]
        source_index = starts_packed[pairs[:, 0]] + pairs[:, 1]
        # Rounding padding forms its own pseudo-sequence, so THD rope and attention see whole blocks.
        boundaries = [0, *torch.tensor(spans).cumsum(0).tolist()] + ([total] if total > sequences_end else [])
        packed_seq_params = _thd_params(boundaries, max(max(spans), total - sequences_end))
        blocks = [(start, end - start) for start, end in zip(boundaries[:-1], boundaries[1:])]
    else:
        width = _round_up(widest, sequence_multiple * tp)
        # Right padding: with causal attention no real token can see a pad, so no mask is needed.
        input_ids = torch.nn.functional.pad(tokens, (0, width - widest)).to(batch.input_ids.dtype)
        labels = torch.nn.functional.pad(next_tokens, (0, width - widest)).to(batch.input_ids.dtype)
        token_cells = torch.nn.functional.pad(cells, (0, width - widest), value=-1)
        source_index = pairs[:, 0] * width + pairs[:, 1]
        position_ids = torch.arange(width).expand(len(rows), width).contiguous()
        packed_seq_params = None
        blocks = [(0, width)]
    context = {}
    if cp > 1:
        from megatron.core import parallel_state

        # Column positions each CP rank keeps, in its local order: its two chunks of every block (sequence).
        local = [torch.cat([start + chunk_positions(span, cp, r) for start, span in blocks]) for r in range(cp)]
        input_ids, position_ids, labels, token_cells = (t[:, local[cp_rank]]
                                                        for t in (input_ids, position_ids, labels, token_cells))
        context = dict(context_order=torch.cat(local), context_group=parallel_state.get_context_parallel_group())
    return MicroBatch(
        rows=list(rows),
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        packed_seq_params=packed_seq_params,
        source_index=source_index,
        target_index=targets,
        target_labels=target_labels.to(batch.input_ids.dtype),
        batch_columns=columns,
        response_length=batch.response_length,
        response_fields=batch.select(rows),
        token_cells=token_cells,
        routed_experts=routing_at(batch, token_cells),
        **context,
    )


def filler_micro_batch(batch: RolloutBatch, row: int, tp: int = 1, cp: int = 1, cp_rank: int = 0) -> MicroBatch:
    """A micro-batch that runs the model on `row`'s tokens and targets nothing: no rows, no loss, no results.

    A rank runs these when it must match its peers' count of micro-batches (megatron_step.shard_micro_batches):
    its collectives inside the forward and backward (the MoE all-to-alls) then pair with theirs."""
    real = build_micro_batch(batch, [row], False, tp, cp, cp_rank)
    nothing = real.target_index[:0]
    return dataclasses.replace(real, rows=[], source_index=nothing, target_index=nothing,
                               target_labels=real.target_labels[:0], response_fields=batch.select([]),
                               token_cells=torch.full_like(real.token_cells, -1), routed_experts=None)


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int):
    """(group [B], prompt length [B], response length [B]) of rows laid out as RolloutBatch's: rows whose prompts
    (their real tokens before the last `response_length` columns) are the same token for token share a group, numbered
    from 0."""
    prompt_columns = input_ids.shape[1] - response_length
    mask = attention_mask.bool()
    in_prompt = mask[:, :prompt_columns]
    _, group_of = torch.unique(torch.where(in_prompt, input_ids[:, :prompt_columns], -1), dim=0, return_inverse=True)
    return group_of, in_prompt.sum(dim=1), mask[:, prompt_columns:].sum(dim=1)


def share_prompt_routing(batch: RolloutBatch, record: torch.Tensor) -> torch.Tensor:
    """`record` ([B, L, MoE layers, k]) with each prompt's routing on every row of its group: a shared-prompt
    micro-batch runs a prompt once, so a pass records it on one row only; rows with the same prompt have it in the
    same columns."""
    group_of, _, _ = prompt_groups(batch.input_ids, batch.attention_mask, batch.response_length)
    prompt = record[:, : record.shape[1] - batch.response_length]
    known = torch.full((int(group_of.max()) + 1, *prompt.shape[1:]), -1, dtype=record.dtype)
    known.index_reduce_(0, group_of, prompt, "amax")
    prompt.copy_(torch.where(prompt >= 0, prompt, known[group_of]))
    return record


def build_shared_prompt_micro_batch(batch: RolloutBatch, rows: list[int], tp: int = 1,
                                    groups: Optional[tuple[torch.Tensor, ...]] = None) -> MicroBatch:
    """`rows` of `batch` in one THD row, those with the same prompt as one group: the prompt's tokens once, then each
    response's tokens at the positions that follow the prompt (models/shared_prompts.py says why this is exact).

    A row's prompt is its real tokens before the last R columns. The total rounds up to a multiple of TP (sequence
    parallelism), the rounding a sequence of its own. Context parallelism is not supported (it splits sequences).
    `groups`: `prompt_groups` of the whole batch, when the caller has it (it is not worked out again for the rows).
    """
    from rlmegatron.models.shared_prompts import SharedPromptParams

    columns, response_columns = batch.input_ids.shape[1], batch.response_length
    prompt_columns = columns - response_columns
    index = torch.as_tensor(rows, dtype=torch.long)
    ids, mask = batch.input_ids[index], batch.attention_mask[index].bool()
    in_prompt, in_response = mask[:, :prompt_columns], mask[:, prompt_columns:]
    if groups is None:
        group_of, row_prompt_lengths, response_lengths = prompt_groups(ids, mask, response_columns)
    else:  # the batch's group numbers, renumbered 0.. over these rows
        batch_groups, row_prompt_lengths, response_lengths = (values[index] for values in groups)
        group_of = torch.unique(batch_groups, return_inverse=True)[1]
    order = torch.argsort(group_of, stable=True)  # the rows group by group, each group's in their given order
    sorted_groups = group_of[order]
    leads = torch.ones(len(rows), dtype=torch.bool)
    leads[1:] = sorted_groups[1:] != sorted_groups[:-1]
    first_rows = order[leads]  # one row per group, in group order: its prompt is the group's
    group_prompt = in_prompt[first_rows]
    prompt_lengths = row_prompt_lengths[first_rows]
    group_tokens = prompt_lengths.index_add(0, group_of, response_lengths)
    group_starts = group_tokens.cumsum(0) - group_tokens
    # Each response starts after its group's prompt and the responses of its group that precede it.
    before = response_lengths[order].cumsum(0) - response_lengths[order]
    sorted_starts = (group_starts + prompt_lengths)[sorted_groups] + before - before[leads][sorted_groups]
    response_starts = torch.empty_like(sorted_starts)
    response_starts[order] = sorted_starts
    used = int(group_tokens.sum())
    total = _round_up(used, tp)

    input_ids = torch.zeros(1, total, dtype=batch.input_ids.dtype)
    position_ids = torch.zeros(1, total, dtype=torch.long)
    # A prompt's positions are its group's first row's cells; each response's, its own row's.
    token_cells = torch.full((1, total), -1, dtype=torch.long)
    row_cells = index[:, None] * columns + torch.arange(columns)
    prompt_rank = group_prompt.cumsum(dim=1) - 1
    at = (group_starts[:, None] + prompt_rank)[group_prompt]
    input_ids[0, at] = ids[first_rows, :prompt_columns][group_prompt]
    position_ids[0, at] = prompt_rank[group_prompt]
    token_cells[0, at] = row_cells[first_rows, :prompt_columns][group_prompt]
    response_rank = in_response.cumsum(dim=1) - 1
    response_at = response_starts[:, None] + response_rank
    input_ids[0, response_at[in_response]] = ids[:, prompt_columns:][in_response]
    position_ids[0, response_at[in_response]] = (prompt_lengths[group_of][:, None] + response_rank)[in_response]
    token_cells[0, response_at[in_response]] = row_cells[:, prompt_columns:][in_response]

    # Every response token is a target, predicted by the token before it: the previous response token, or for the
    # first one the prompt's last token (none when the prompt is empty).
    prompt_last = (group_starts + prompt_lengths - 1)[group_of][:, None].expand_as(response_at)
    sources = torch.where(response_rank == 0, prompt_last, response_at - 1)
    predicted = in_response & ((response_rank > 0) | (prompt_lengths[group_of] > 0)[:, None])
    cells = torch.arange(len(rows))[:, None] * columns + prompt_columns + torch.arange(response_columns)
    responses: list[list[tuple[int, int]]] = [[] for _ in first_rows]
    for start, size, group in zip(sorted_starts.tolist(), response_lengths[order].tolist(), sorted_groups.tolist()):
        if size:
            responses[group].append((start, size))
    groups = tuple((start, length, tuple(members))
                   for start, length, members in zip(group_starts.tolist(), prompt_lengths.tolist(), responses))
    longest = int((prompt_lengths[group_of] + response_lengths).max())
    return MicroBatch(
        rows=list(rows),
        input_ids=input_ids,
        position_ids=position_ids,
        labels=None,
        packed_seq_params=_thd_params([0, total], longest, SharedPromptParams, prompt_groups=groups),
        source_index=sources[predicted],
        target_index=cells[predicted],
        target_labels=ids[:, prompt_columns:][predicted],
        batch_columns=columns,
        response_length=response_columns,
        response_fields=batch.select(rows),
        token_cells=token_cells,
        routed_experts=routing_at(batch, token_cells),
    )


def _thd_params(boundaries: list[int], max_seqlen: int, params_class=None, **fields):
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor(boundaries, dtype=torch.int32)
    if torch.cuda.is_available():
        cu_seqlens = cu_seqlens.cuda()
    return (params_class or PackedSeqParams)(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        cp_group=parallel_state.get_context_parallel_group(),
        **fields,
    )
