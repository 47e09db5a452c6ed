"""Shared-prompt micro-batches: the n responses to one prompt (GRPO's group) trained over one copy of the prompt.

A group is laid out THD-style as its prompt's tokens, then each response's tokens. Causal attention makes the prompt's
hidden states independent of every response, so computing them once and letting each response attend to them (and to
its own earlier tokens only) gives each sequence exactly the outputs it has alone, and the prompt's gradient is the
sum of the n sequences' gradients, as in separate sequences. What changes is the work: the prompt goes through the
linear layers once, not n times (benchmarks/RESULTS.md, "Third round: shared-prompt micro-batches").

Two things differ from plain THD packing, and this module and `models/layers.SDPACoreAttention` provide them:
- each response's tokens continue the prompt's positions, so rotary embeddings are taken per token
  (`rope_at_token_positions`; Megatron-Core applies a per-token table to THD input when the table has one row per
  token), not restarted per packed sequence;
- attention follows the groups (`SharedPromptParams.prompt_groups`): a response sees its prompt and itself.
The builder is `rank/roles/batch.build_shared_prompt_micro_batch`.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from rlmegatron.models.layers import SDPACoreAttention

PromptGroup = tuple[int, int, tuple[tuple[int, int], ...]]
"""(first token, prompt length, ((first token, length) of each response)) in the micro-batch's THD layout."""


@dataclass
class SharedPromptParams(PackedSeqParams):
    """THD parameters of a shared-prompt micro-batch. `cu_seqlens_*` cover the whole micro-batch as one sequence, so
    Megatron's rotary code applies the per-token table in one call; `max_seqlen_*` is the longest prompt + response,
    the rotary table's length; the attention reads the groups."""

    prompt_groups: tuple[PromptGroup, ...] = ()


def shared_prompts_supported(chunks: list) -> bool:
    """Whether these model chunks can run shared-prompt micro-batches: rotary position embeddings from the GPTModel,
    plain or multimodal (not MLA's, whose attention applies its own), no multi-token prediction (its shifted labels would cross from one
    response into the next), no context parallelism (whose chunks split sequences), no linear-attention layers (Gated
    DeltaNet's recurrence would carry one response's state into the next), and every core attention this package's
    SDPACoreAttention, which reads the groups (Transformer Engine's would attend across responses)."""
    return all(_supported(chunk.module if hasattr(chunk, "module") else chunk) for chunk in chunks)


_SUPPORT: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _supported(model) -> bool:
    if model not in _SUPPORT:  # asked once per micro-batching; a model's modules are walked once
        config = model.config
        attention = [module for name, module in model.named_modules() if name.endswith("core_attention")]
        _SUPPORT[model] = bool(
            getattr(model, "position_embedding_type", None) in ("rope", "mrope", "yarn")
            and not config.multi_latent_attention
            and not config.mtp_num_layers and config.context_parallel_size == 1 and not config.linear_attention_freq
            and attention and all(isinstance(module, SDPACoreAttention) for module in attention))
    return _SUPPORT[model]


@contextlib.contextmanager
def rope_at_token_positions(model, position_ids: torch.Tensor, length: int) -> Iterator[None]:
    """While a forward of `model` (a GPTModel) runs, its rotary embedding is Megatron's own table (its scaling and
    interleaving included) looked up at each token's position: [tokens, 1, 1, dim]. The layers receive that tensor
    as an argument, so activation recompute and pipeline backward reuse it after the context ends."""
    rotary = model.rotary_pos_emb
    table_for = rotary.forward  # cached per length by Megatron

    def at_positions(*_args, **_kwargs):
        table = table_for(length)
        if isinstance(table, tuple):  # YaRN's (table, attention factor), as its forward returns them
            return table[0][position_ids.reshape(-1)], *table[1:]
        return table[position_ids.reshape(-1)]

    rotary.forward = at_positions
    try:
        yield
    finally:
        del rotary.forward  # the class's method again
