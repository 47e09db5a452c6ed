"""Loss aggregation: turning a [batch, resp_len] per-token loss into a scalar that is exact under DP and micro-batching.

Every mode is written as ``numerator / denominator`` where the numerator is a sum over sequences
of a per-sequence quantity, and the denominator counts *tokens* (``token-*`` modes), non-empty
*sequences* (``seq-mean-*`` modes), or nothing at all:

===========================  ====================================  ===================
mode                         numerator                             denominator
===========================  ====================================  ===================
``token-mean``               sum_i sum_t l_it                      valid tokens
``seq-mean-token-sum``       sum_i sum_t l_it                      non-empty sequences
``seq-mean-token-mean``      sum_i (sum_t l_it / n_i)              non-empty sequences
``seq-mean-token-sum-norm``  sum_i sum_t l_it / max_response_len   1
===========================  ====================================  ===================

``seq-mean-token-sum-norm`` is Dr. GRPO's constant normaliser, as verl's ``agg_loss`` computes it:
the token sum over the whole batch divided by the maximum response length only, so a config ported
from verl gets the same gradient scale (not one divided again by the number of sequences).

Because the numerator is additive over sequences, a micro-batch divided by the denominator of the
*whole* mini-batch (all micro-batches on all DP ranks, see :func:`global_denominator`) contributes
exactly its share: summing those micro-batch losses (and their gradients) over micro-batches and DP
ranks reproduces the full-batch loss. Dividing each micro-batch by its *own* denominator, as a
naive gradient-accumulation loop does, weights tokens unevenly whenever micro-batches differ in
token or sequence count.

The sum over DP ranks is what the gradient all-reduce must compute. Megatron-Core rescales around
that sum: by default its schedule divides each micro-batch loss by the number of micro-batches and
its DDP averages gradients over DP ranks; with ``calculate_per_token_loss`` it sums, then divides by
the token count the loss function reports. The worker wiring these losses into Megatron must undo
whichever factors its configuration applies (e.g. multiply by ``num_microbatches * dp_size`` in the
default mode) and check that against the pinned Megatron-Core version.

Fully masked rows (padding rows added to even out DP shards) count as no sequence at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from rlmegatron.algorithms.masked import mask_count, masked_sum
from rlmegatron.algorithms.registry import Registry

# (loss_per_token, response_mask, max_response_length) -> numerator, a scalar additive over sequences
AggregationNumerator = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

LOSS_AGGREGATIONS: Registry[AggregationNumerator] = Registry("loss aggregation mode")


@LOSS_AGGREGATIONS.register("token-mean", "seq-mean-token-sum")
def token_sum_numerator(
    loss_per_token: torch.Tensor, response_mask: torch.Tensor, max_response_length: int
) -> torch.Tensor:
    """Sum of the loss over every valid token; the two modes differ only in their denominator."""
    return masked_sum(loss_per_token, response_mask)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def per_sequence_mean_numerator(
    loss_per_token: torch.Tensor, response_mask: torch.Tensor, max_response_length: int
) -> torch.Tensor:
    """Sum over sequences of each sequence's token-mean (a fully masked row contributes 0)."""
    per_sequence_sum = masked_sum(loss_per_token, response_mask, dim=-1)
    return (per_sequence_sum / mask_count(response_mask, dim=-1).clamp(min=1)).sum()


LENGTH_NORMALISED = "seq-mean-token-sum-norm"


@LOSS_AGGREGATIONS.register(LENGTH_NORMALISED)
def length_normalised_numerator(
    loss_per_token: torch.Tensor, response_mask: torch.Tensor, max_response_length: int
) -> torch.Tensor:
    """Token sum divided by a constant length, Dr. GRPO's fix for the 1/|o_i| length bias."""
    return masked_sum(loss_per_token, response_mask) / max_response_length


def local_denominator(response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This micro-batch's share of the denominator: its valid tokens, its non-empty sequences, or 0.

    ``seq-mean-token-sum-norm`` counts nothing (its share is 0, and :func:`aggregate_loss` divides
    it by 1 whatever denominator it is given), so summing shares over micro-batches and DP ranks
    stays correct for every mode.
    """
    LOSS_AGGREGATIONS.get(mode)
    if mode == LENGTH_NORMALISED:
        return torch.zeros((), dtype=torch.int64, device=response_mask.device)
    if mode.startswith("token-"):
        return mask_count(response_mask)
    return (mask_count(response_mask, dim=-1) > 0).sum()


def global_denominator(
    micro_batch_masks: Iterable[torch.Tensor],
    mode: str,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Denominator of the whole mini-batch: summed over these micro-batches, then over the DP group.

    The all-reduce runs only when torch.distributed is initialised; ``process_group=None`` then
    means the default (world) group, so pass the data-parallel group explicitly under TP/PP/CP.
    The count is an exact int64; every rank gets the same value.
    """
    total = sum(local_denominator(mask, mode) for mask in micro_batch_masks)
    if not isinstance(total, torch.Tensor):
        raise ValueError("global_denominator needs at least one micro-batch mask")
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group)
    return total


@dataclass(frozen=True)
class LossAggregation:
    """How a per-token loss becomes a scalar.

    ``global_denominator``: from :func:`global_denominator` for the same ``mode``; ``None`` divides
    by this micro-batch's own count (correct only when the micro-batch is the whole batch).
    ``seq-mean-token-sum-norm`` ignores it: its only normaliser is the constant length.
    ``max_response_length``: the constant of ``seq-mean-token-sum-norm``; ``None`` uses the mask
    width, so set it whenever micro-batches are padded to different widths.
    """

    mode: str = "token-mean"
    global_denominator: torch.Tensor | float | None = None
    max_response_length: int | None = None

    def __post_init__(self) -> None:
        LOSS_AGGREGATIONS.get(self.mode)


def aggregate_loss(
    loss_per_token: torch.Tensor, response_mask: torch.Tensor, aggregation: LossAggregation = LossAggregation()
) -> torch.Tensor:
    """Aggregate a [batch, resp_len] loss to a scalar following ``aggregation`` (see the module docstring)."""
    max_response_length = aggregation.max_response_length or response_mask.shape[-1]
    numerator = LOSS_AGGREGATIONS.get(aggregation.mode)(loss_per_token, response_mask, max_response_length)
    if aggregation.mode == LENGTH_NORMALISED:
        return numerator
    denominator = aggregation.global_denominator
    if denominator is None:
        denominator = local_denominator(response_mask, aggregation.mode)
    # Cast so a 0-dim int64/float64 count cannot promote a 0-dim float32/bf16 loss; the clamp
    # makes an all-masked batch (every response filtered out) a zero loss instead of NaN weights.
    denominator = torch.as_tensor(denominator, device=numerator.device).to(numerator.dtype).clamp(min=1)
    return numerator / denominator
