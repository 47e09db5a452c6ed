"""Megatron model chunks and the micro-batched forward(-backward) pass the actor, reference and critic share."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from rlmegatron.models.routing_replay import RoutingTaps
from rlmegatron.runtime.cpu_compat import plain_torch
from rlmegatron.runtime.distributed import all_reduce_shared, transformer_config_overrides
from rlmegatron.runtime.sharded_save import save_sharded
from rlmegatron.rank.roles.batch import MicroBatch, RolloutBatch, balanced_partition, build_micro_batch
from rlmegatron.rank.roles.batch import build_shared_prompt_micro_batch, filler_micro_batch, fixed_micro_batches
from rlmegatron.rank.roles.batch import prompt_groups, split_largest, split_to_multiple, token_budget_micro_batches

# (pre_process, post_process, vp_stage) -> the GPTModel chunk for this rank; the HF bridge plugs in here.
ModelProvider = Callable[[bool, bool, Optional[int]], torch.nn.Module]


def gpt_model_provider(config, vocab_size: int, max_sequence_length: int, tie_embeddings: bool = True,
                       use_te: Optional[bool] = None) -> ModelProvider:
    """A ModelProvider for a GPTModel with rope from a TransformerConfig (built for the current layout)."""
    from megatron.core.models.gpt import GPTModel

    from rlmegatron.models.spec import decoder_block_spec

    def provide(pre_process: bool, post_process: bool, vp_stage: Optional[int]):
        return GPTModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(config, use_te=use_te, vp_stage=vp_stage),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=tie_embeddings,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        )

    return provide


def build_model_chunks(provider: ModelProvider, wrap_ddp: bool, use_distributed_optimizer: bool = True) -> list:
    """This rank's model chunks (one, or one per virtual pipeline stage), DDP-wrapped for training."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        model = provider(
            ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage,
        )
        if torch.cuda.is_available():
            model = model.cuda()
        else:
            # gloo needs these schedule settings; apply them even when the caller's config lacks them.
            for name, value in transformer_config_overrides("cpu").items():
                setattr(model.config, name, value)
        # Micro-batches are unpadded, so their lengths differ; PP must exchange shapes first.
        model.config.variable_seq_lengths = True
        if wrap_ddp:
            model.config.finalize_model_grads_func = finalize_model_grads
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
            )
            model = DistributedDataParallel(model.config, ddp_config, model)
        else:
            model.requires_grad_(False)
        chunks.append(model)
    return chunks


def unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def innermost(chunk):
    """The GPTModel inside every wrapper (DDP, Float16Module)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def dp_size() -> int:
    """Data-parallel ranks, each with its own rows (the CP ranks of one share them)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


# Right padding costs compute on the pads; THD packing costs none, but each packed sequence pays for its own RoPE
# call (Megatron's THD RoPE loops over the sequences) and attention groups them by length. A micro-batch is packed
# when padding would add more than this fraction of its tokens: short sequences of similar lengths run as one batched
# call, faster than packed (benchmarks/RESULTS.md, "Measured reasons in the code"); long and varied ones packed.
PACK_ABOVE_PADDING = 0.25


def packing_pays(lengths: list[int], length_multiple: int = 1) -> bool:
    """Whether right-padding `lengths` (rounded up to `length_multiple`) would add more than PACK_ABOVE_PADDING of
    their tokens."""
    padded = len(lengths) * -(-max(lengths) // length_multiple) * length_multiple
    return padded > (1 + PACK_ABOVE_PADDING) * sum(lengths)


# Shared-prompt micro-batches (models/shared_prompts.py) are used when laying out each prompt once would leave at most
# this fraction of the batch's tokens. On TRL's echo model (benchmarks/shared_prompts.py, RESULTS.md) a whole update
# took 0.71x the time at 0.34 of the tokens, 0.91x at 0.56, 0.95-0.99x at 0.70-0.71 and 1.03x at 0.88: the layout
# adds a few index operations per micro-batch and attention calls per layer, which a model that tiny notices. On a
# Qwen3 of hidden size 256 and 4 layers the time followed the tokens (0.51x at 0.50, 0.81x at 0.81, 0.88x at 0.93).
SHARE_PROMPTS_BELOW = 0.8


def shard_micro_batches(batch: RolloutBatch, pack: Optional[bool], micro_batch_size: int,
                        max_token_len: Optional[int], share_prompts: Optional[bool] = False) -> list[MicroBatch]:
    """This DP rank's token-balanced share of `batch`, cut into micro-batches (by token budget if given), each
    packed or right-padded as `pack` says (None: as `packing_pays`). The CP ranks of a DP rank get the same rows,
    each sequence split over them. With `share_prompts` (only where the model supports it: shared_prompts_supported),
    the responses to one prompt go to one rank and one micro-batch, which lays the prompt out once: always (True)
    or when that saves enough tokens (None; SHARE_PROMPTS_BELOW).

    With expert parallelism every DP rank runs the same number of micro-batches (`_same_count_as_peers`)."""
    from megatron.core import parallel_state as ps

    lengths = batch.sequence_lengths().tolist()
    dp, dp_rank = dp_size(), ps.get_data_parallel_rank()
    # Every row's prompt group, worked out once: the units and every micro-batch's layout read it.
    prompts = None if share_prompts is False else prompt_groups(batch.input_ids, batch.attention_mask,
                                                                batch.response_length, batch.images)
    units = None if prompts is None else prompt_units(prompts, micro_batch_size, max_token_len, dp,
                                                      share_prompts is None)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()

    def cut(share: list[int]) -> list[list[int]]:
        """One DP rank's share (units or rows) -> its micro-batches' rows."""
        if units is not None:
            unit_rows, unit_tokens = units
            if max_token_len is not None:
                unit_groups = token_budget_micro_batches(share, unit_tokens, max_token_len)
            else:
                unit_groups = _fill_micro_batches(share, [len(rows) for rows in unit_rows], micro_batch_size)
            groups = [[row for unit in group for row in unit_rows[unit]] for group in unit_groups]
        elif max_token_len is not None:
            groups = token_budget_micro_batches(share, lengths, max_token_len)
        else:
            groups = fixed_micro_batches(share, micro_batch_size)
        return split_to_multiple(groups, lengths, pp) if vpp else groups

    shares = balanced_partition(lengths if units is None else units[1], dp)
    groups = cut(shares[dp_rank])
    fillers = 0
    if ps.get_expert_model_parallel_world_size() > 1:
        groups, fillers = _same_count_as_peers(groups, [cut(share) for r, share in enumerate(shares) if r != dp_rank],
                                               lengths)
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    if units is not None:
        built = [build_shared_prompt_micro_batch(batch, rows, tp, prompts) for rows in groups]
    else:
        padded_multiple = tp * 2 * cp if cp > 1 else tp  # what build_micro_batch rounds a padded width up to
        built = [build_micro_batch(batch, rows, packing_pays([lengths[r] for r in rows], padded_multiple)
                                   if pack is None else pack, tp, cp, ps.get_context_parallel_rank())
                 for rows in groups]
    if fillers:
        shortest = min(range(len(lengths)), key=lengths.__getitem__)
        built += [filler_micro_batch(batch, shortest, tp, cp, ps.get_context_parallel_rank())] * fillers
    return built


def _same_count_as_peers(groups: list[list[int]], peers: list[list[list[int]]],
                         lengths: list[int]) -> tuple[list[list[int]], int]:
    """`groups` (this rank's micro-batches) as many as the most any peer DP rank has, and how many fillers
    (`filler_micro_batch`) that still takes.

    An MoE layer at EP > 1 exchanges tokens with the other ranks of its EP group, which hold other DP ranks' rows, in
    each micro-batch's forward and backward: a rank that ran fewer micro-batches would leave its peers waiting in an
    all-to-all for good. Every rank holds the whole batch and cuts every share alike, so each works out its peers'
    counts itself, without a collective. Its own micro-batches are split first (real work, only smaller); a rank
    with fewer sequences than the count runs fillers for the rest. Counts from the interleaved schedule's split are
    multiples of PP already, so the largest is too."""
    most = max([len(groups), *(len(peer) for peer in peers)])
    groups = split_largest(groups, lengths, lambda count: count >= most)
    return groups, most - len(groups)


def prompt_units(prompts: tuple[torch.Tensor, ...], micro_batch_size: int, max_token_len: Optional[int], ranks: int,
                 only_if_it_pays: bool = True) -> Optional[tuple[list[list[int]], list[int]]]:
    """The rows of a batch (`prompts`: its `batch.prompt_groups`) cut into units that share a prompt and fit one micro-batch
    (`micro_batch_size` rows, or `max_token_len` tokens laid out shared), and each unit's token count; None when there
    are fewer units than `ranks` to spread them over, or (`only_if_it_pays`) sharing would not save enough
    (SHARE_PROMPTS_BELOW)."""
    group_of, prompt_lengths, response_lengths = (values.tolist() for values in prompts)
    members: dict[int, list[int]] = {}
    for row, group in enumerate(group_of):
        members.setdefault(group, []).append(row)
    unit_rows, unit_tokens = [], []
    for rows in members.values():
        prompt = prompt_lengths[rows[0]]
        unit: list[int] = []
        tokens = prompt
        for row in rows:
            size = response_lengths[row]
            full = len(unit) == micro_batch_size if max_token_len is None else tokens + size > max_token_len
            if unit and full:
                unit_rows.append(unit)
                unit_tokens.append(tokens)
                unit, tokens = [], prompt
            unit.append(row)
            tokens += size
        unit_rows.append(unit)
        unit_tokens.append(tokens)
    tokens_unshared = sum(prompt_lengths) + sum(response_lengths)
    if len(unit_rows) < ranks or (only_if_it_pays and sum(unit_tokens) > SHARE_PROMPTS_BELOW * tokens_unshared):
        return None
    return unit_rows, unit_tokens


def _fill_micro_batches(units: list[int], sizes: list[int], micro_batch_size: int) -> list[list[int]]:
    """`units` in order, into micro-batches of at most `micro_batch_size` rows (each unit fits one by itself)."""
    groups: list[list[int]] = []
    rows = micro_batch_size
    for unit in units:
        if rows + sizes[unit] > micro_batch_size:
            groups.append([])
            rows = 0
        groups[-1].append(unit)
        rows += sizes[unit]
    return groups


def forward_backward(chunks: list, micro_batches: list[MicroBatch], loss_func_for: Callable, forward_only: bool,
                     routing: Optional[RoutingTaps] = None, mtp: bool = False):
    """Run Megatron's schedule over `micro_batches`; returns the loss functions' dicts (last stage only), an empty
    one for each filler. `routing`: the model's router taps, which replay, record or compare each micro-batch's
    routing as their mode says (models/routing_replay.py). `mtp`: the model's MTP layers run too, and the loss
    function gets their logits as a third argument (models/mtp.predicting_ahead)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlmegatron.models.mtp import predicting_ahead
    from rlmegatron.models.shared_prompts import SharedPromptParams, rope_at_token_positions

    def forward_step(data_iterator: Iterator[MicroBatch], model):
        micro_batch = next(data_iterator).to("cuda" if torch.cuda.is_available() else "cpu")
        params = micro_batch.packed_seq_params
        gpt = innermost(model)
        position_ids, images = micro_batch.position_ids, {}
        if gpt.position_embedding_type == "mrope":
            if position_ids.dim() == 2:  # a text-only batch: its text positions, the same on the three axes
                position_ids = position_ids.expand(3, *position_ids.shape)
            if micro_batch.pixel_values is not None:
                images = dict(pixel_values=micro_batch.pixel_values, image_grid_thw=micro_batch.image_grid_thw,
                              prompt_mask=micro_batch.in_prompt)
        # M-RoPE's table already holds one row per token (Megatron applies it to THD input as it is); plain rotary
        # embeddings are looked up at each token's position in a shared-prompt micro-batch.
        per_token_rope = isinstance(params, SharedPromptParams) and gpt.position_embedding_type in ("rope", "yarn")
        with (rope_at_token_positions(gpt, micro_batch.position_ids, params.max_seqlen_q)
              if per_token_rope else contextlib.nullcontext()), \
                (contextlib.nullcontext() if routing is None else routing.forward(model, micro_batch)), \
                (predicting_ahead(gpt) if mtp else contextlib.nullcontext()) as ahead:
            output = model(micro_batch.input_ids, position_ids, None, packed_seq_params=params, **images)
        if not micro_batch.rows:  # a filler: its backward runs (and pairs its collectives) with zero gradients
            # The MTP layers' too: an MTP layer may be MoE, whose backward all-to-alls pair with the peers'.
            return output, lambda output_tensor: (sum(t.sum() for t in [output_tensor, *(ahead or ())]) * 0.0, {})
        def loss(output_tensor):
            with plain_torch():  # the loss is this project's torch code, which names no device
                return loss_func_for(micro_batch, output_tensor, *([ahead] if mtp else []))

        return output, loss

    from megatron.core import parallel_state as ps

    iterators = [iter(micro_batches) for _ in chunks]
    first = micro_batches[0]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=first.input_ids.shape[1] * ps.get_context_parallel_world_size(),  # the whole sequence
        micro_batch_size=first.input_ids.shape[0],
        forward_only=forward_only,
    )


def share_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over PP then DP: last-stage ranks hold their DP shard's rows, every other rank zeros.

    Each row is filled by exactly one DP rank's last stage (the CP ranks of a DP rank all hold the same
    gathered rows), so the sums are exact and every rank ends with the whole batch.
    """
    from megatron.core import parallel_state as ps

    all_reduce_shared(tensor, ps.get_pipeline_model_parallel_group())
    return all_reduce_shared(tensor, ps.get_data_parallel_group())


def run_forward_only(chunks: list, batch: RolloutBatch, micro_batches: list[MicroBatch], per_token: Callable,
                     outputs: int, routing: Optional[RoutingTaps] = None) -> list[torch.Tensor]:
    """Forward `micro_batches`; `per_token(micro_batch, output) -> tuple of [n, R]`; returns `outputs` [B, R] tensors.
    `routing` as forward_backward's."""
    for chunk in chunks:
        chunk.eval()

    def loss_func_for(micro_batch, output_tensor):
        results = per_token(micro_batch, output_tensor)
        return torch.zeros((), device=output_tensor.device), {"rows": micro_batch.rows, "results": results}

    with torch.no_grad():
        collected = forward_backward(chunks, micro_batches, loss_func_for, forward_only=True, routing=routing)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = torch.zeros(outputs, len(batch), batch.response_length, device=device)
    if is_last_stage():
        for item in filter(None, collected):  # fillers bring nothing
            rows = torch.as_tensor(item["rows"], device=device)
            for k, result in enumerate(item["results"]):
                full[k, rows] = result.float()
    share_from_last_stage(full)
    return list(full.cpu().unbind(0))


def _sharded_state_dict(chunks) -> dict:
    if len(chunks) == 1:
        return unwrap(chunks[0]).sharded_state_dict()
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_weights(chunks: list, path: str) -> None:
    """Model weights as a Megatron distributed checkpoint, loadable at any other layout."""
    save_sharded(_sharded_state_dict(chunks), path)


def load_weights(chunks: list, path: str, skip_prefixes: tuple[str, ...] = ()) -> None:
    """Load a distributed checkpoint; keys starting with `skip_prefixes` keep their current values."""
    from megatron.core import dist_checkpointing

    def keep(state: dict) -> dict:
        return {k: v for k, v in state.items() if not k.startswith(skip_prefixes)}

    if len(chunks) == 1:
        state = dist_checkpointing.load(keep(_sharded_state_dict(chunks)), path)
        unwrap(chunks[0]).load_state_dict(state, strict=not skip_prefixes)
        return
    sharded = {name: keep(sd) for name, sd in _sharded_state_dict(chunks).items()}
    state = dist_checkpointing.load(sharded, path)
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(state[f"model{i}"], strict=not skip_prefixes)
