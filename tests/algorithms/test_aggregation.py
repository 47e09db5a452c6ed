"""Loss aggregation modes and their exactness under DP shards and uneven micro-batches.

The single-batch values mirror verl.trainer.ppo.core_algos.agg_loss for every mode, including
``seq-mean-token-sum-norm``: the token sum over the batch divided by the max response length only.
(An earlier version here also divided that by the number of sequences, so a config ported from verl
trained with gradients num_sequences times smaller; the expected values below changed with it.)
"""


import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from rlmegatron.algorithms import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    UnknownNameError,
    aggregate_loss,
    global_denominator,
    local_denominator,
)

from rlmegatron.transport.local_ranks import run_ranks

from .batches import random_mask

MODES = LOSS_AGGREGATIONS.names()

# Two sequences of lengths 3 and 1, plus a padding row with no valid token.
HAND_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [9.0, 9.0, 9.0]])
HAND_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 10.0 / 4.0),  # (1 + 2 + 3 + 4) / 4 valid tokens = 2.5
        ("seq-mean-token-sum", 10.0 / 2.0),  # (6 + 4) / 2 non-empty sequences = 5
        ("seq-mean-token-mean", 3.0),  # (6/3 + 4/1) / 2 = (2 + 4) / 2 = 3
        ("seq-mean-token-sum-norm", 10.0 / 3.0),  # (6 + 4) / max_len 3 = 3.3333; no division by the 2 sequences
    ],
)
def test_modes_by_hand(mode, expected):
    assert_close(aggregate_loss(HAND_LOSS, HAND_MASK, LossAggregation(mode)), torch.tensor(expected))


def test_token_sum_norm_divides_by_the_constant_only():
    # Whatever denominator a caller passes (the sequence count, say), only the constant length divides.
    norm = LossAggregation("seq-mean-token-sum-norm", global_denominator=torch.tensor(2), max_response_length=5)
    assert_close(aggregate_loss(HAND_LOSS, HAND_MASK, norm), torch.tensor(10.0 / 5.0))
    # Twice the sequences, twice the loss: the sum is not averaged over sequences.
    doubled = aggregate_loss(torch.cat([HAND_LOSS, HAND_LOSS]), torch.cat([HAND_MASK, HAND_MASK]), norm)
    assert_close(doubled, torch.tensor(2 * 10.0 / 5.0))


def test_explicit_normaliser_and_global_denominator():
    # numerator 10 over a caller-supplied 8 tokens
    assert_close(aggregate_loss(HAND_LOSS, HAND_MASK, LossAggregation("token-mean", 8)), torch.tensor(1.25))
    assert_close(
        aggregate_loss(HAND_LOSS, HAND_MASK, LossAggregation("token-mean", torch.tensor(8))), torch.tensor(1.25)
    )


def test_denominators_by_hand():
    assert local_denominator(HAND_MASK, "token-mean").item() == 4
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        assert local_denominator(HAND_MASK, mode).item() == 2  # the padding row is no sequence
    assert local_denominator(HAND_MASK, "seq-mean-token-sum-norm").item() == 0  # counts nothing
    assert global_denominator([HAND_MASK, HAND_MASK[1:2]], "seq-mean-token-sum-norm").item() == 0
    # 4 + 1 tokens; 2 + 1 sequences
    assert global_denominator([HAND_MASK, HAND_MASK[1:2]], "token-mean").item() == 5
    assert global_denominator([HAND_MASK, HAND_MASK[1:2]], "seq-mean-token-mean").item() == 3
    assert global_denominator([HAND_MASK], "token-mean").dtype == torch.int64


def test_all_masked_batch_gives_zero_loss_not_nan():
    loss = torch.ones(2, 3, requires_grad=True)
    for mode in MODES:
        value = aggregate_loss(loss, torch.zeros(2, 3), LossAggregation(mode))
        value.backward()
        assert value.item() == 0.0 and torch.isfinite(loss.grad).all()


def test_unknown_mode_is_rejected_with_known_names():
    with pytest.raises(UnknownNameError, match="known: seq-mean-token-mean"):
        LossAggregation("seq-mean")
    with pytest.raises(UnknownNameError):
        global_denominator([HAND_MASK], "token-sum")
    with pytest.raises(ValueError, match="at least one"):
        global_denominator([], "token-mean")


def test_bf16_loss_stays_bf16():
    loss = HAND_LOSS.bfloat16()
    assert aggregate_loss(loss, HAND_MASK, LossAggregation("token-mean", torch.tensor(4))).dtype == torch.bfloat16


def _reference(loss, mask, mode, max_len):
    """Each mode's definition, written per sequence with Python loops."""
    per_sequence = []
    for i in range(loss.shape[0]):
        valid = loss[i][mask[i].bool()]
        if valid.numel() == 0:
            continue
        per_sequence.append(
            {
                "seq-mean-token-sum": valid.sum(),
                "seq-mean-token-mean": valid.mean(),
                "seq-mean-token-sum-norm": valid.sum() / max_len,
            }.get(mode, valid)
        )
    if mode == "token-mean":
        return torch.cat(per_sequence).mean()
    if mode == "seq-mean-token-sum-norm":
        return torch.stack(per_sequence).sum()  # Dr. GRPO / verl: a sum over sequences, no mean
    return torch.stack(per_sequence).mean()


@pytest.mark.parametrize("mode", MODES)
def test_modes_match_their_definitions_on_random_inputs(mode):
    generator = torch.Generator().manual_seed(1)
    loss = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    mask = random_mask(7, 5, generator, holes=True)
    mask[0, 0] = 1.0
    assert_close(aggregate_loss(loss, mask, LossAggregation(mode)), _reference(loss, mask, mode, 5))


def _sharded_batch():
    """11 sequences (some empty) split into DP shards of 6 and 5, then into uneven micro-batches."""
    generator = torch.Generator().manual_seed(2)
    batch, resp_len = 11, 6
    features = torch.randn(batch, resp_len, generator=generator, dtype=torch.float64)
    mask = random_mask(batch, resp_len, generator, holes=True)
    mask[3] = 0.0  # a DP padding row
    mask[0, :2] = 1.0
    shards = [[slice(0, 1), slice(1, 4), slice(4, 6)], [slice(6, 10), slice(10, 11)]]
    return features, mask, shards


def _per_token_loss(weight: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """A nonlinear function of a shared parameter, so gradients differ per token."""
    return torch.sin(weight * features) + weight.square() * features


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_across_dp_ranks_sum_to_the_full_batch(mode):
    features, mask, shards = _sharded_batch()
    full_weight = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    full_loss = aggregate_loss(_per_token_loss(full_weight, features), mask, LossAggregation(mode))
    full_loss.backward()

    # What each rank computes before the all-reduce: its own micro-batches' share of the denominator.
    per_rank_share = [global_denominator([mask[mb] for mb in shard], mode) for shard in shards]
    denominator = sum(per_rank_share)  # the all-reduce
    weight = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    total = torch.zeros((), dtype=torch.float64)
    for shard in shards:
        for micro_batch in shard:
            aggregation = LossAggregation(mode, global_denominator=denominator)
            micro_loss = aggregate_loss(_per_token_loss(weight, features[micro_batch]), mask[micro_batch], aggregation)
            micro_loss.backward()  # gradient accumulation; the DP all-reduce is a sum of these
            total = total + micro_loss.detach()

    assert_close(total, full_loss.detach())
    assert_close(weight.grad, full_weight.grad)


def test_naive_per_micro_batch_normalisation_is_not_exact():
    """Control for the test above: averaging micro-batch-local means is biased, so the test has teeth."""
    features, mask, shards = _sharded_batch()
    micro_batches = [mb for shard in shards for mb in shard]
    for mode in ("token-mean", "seq-mean-token-mean"):
        full = aggregate_loss(features, mask, LossAggregation(mode))
        naive = sum(aggregate_loss(features[mb], mask[mb], LossAggregation(mode)) for mb in micro_batches)
        assert not torch.allclose(naive / len(micro_batches), full)


def _dp_rank(features, mask, shards):
    # The process group is run_ranks'; each rank takes its own shard, as a DP rank would.
    shard = shards[dist.get_rank()]
    results = {}
    for mode in MODES:
        denominator = global_denominator([mask[mb] for mb in shard], mode)
        weight = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        rank_loss = sum(
            aggregate_loss(_per_token_loss(weight, features[mb]), mask[mb], LossAggregation(mode, denominator))
            for mb in shard
        )
        rank_loss.backward()
        reduced = torch.stack([rank_loss.detach(), weight.grad])
        dist.all_reduce(reduced)  # what the gradient all-reduce does, as a sum
        results[mode] = (denominator.item(), reduced.tolist())
    return results


def test_global_denominator_all_reduces_over_a_real_process_group():
    # Ranks come from run_ranks' fork server, not a fork of this process: a fork of a process that has run
    # autograd and OpenMP can hang in the child (it did, once, on CI).
    features, mask, shards = _sharded_batch()
    results = run_ranks(_dp_rank, 2, features, mask, shards, timeout_s=120)

    for mode in MODES:
        weight = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        full_loss = aggregate_loss(_per_token_loss(weight, features), mask, LossAggregation(mode))
        full_loss.backward()
        expected_denominator = local_denominator(mask, mode).item()
        for rank in range(2):
            denominator, (loss_sum, grad_sum) = results[rank][mode]
            assert denominator == expected_denominator  # every rank sees the global count
            assert loss_sum == pytest.approx(full_loss.item(), rel=1e-12)
            assert grad_sum == pytest.approx(weight.grad.item(), rel=1e-12)
