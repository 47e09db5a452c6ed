"""NaN in the weights is found where training would use it, alike on every rank: after an optimizer step whose grad
norm is finite, and in the actor's and reference's log-probs and entropy and the critic's values (CPU/gloo, TP=2)."""
import pytest
import torch

from rlmegatron.errors import Divergence
from rlmegatron.transport.local_ranks import run_ranks
from rlmegatron.rank.roles.training import raise_if_not_finite_tokens
from tests.rank.roles.jobs import divergence_job


@pytest.fixture(scope="module")
def reports():
    return run_ranks(divergence_job, 2, timeout_s=300)


def test_every_rank_stops_after_an_optimizer_step_that_left_nan_in_one_ranks_weights(reports):
    assert [r["finite_before"] for r in reports] == [True, True]
    assert [r["finite_after_poison"] for r in reports] == [False, False]  # only one rank holds the row
    for report in reports:
        assert report["update"] == ("actor/weights: NaN or inf in the weights: stopped after the optimizer step, so "
                                    "the weights in memory are not usable")


def test_non_finite_log_probs_entropy_and_values_are_named_with_their_count(reports):
    tokens = reports[0]["response_tokens"]
    for report in reports:
        assert report["log_prob"] == (f"actor/old_log_prob: {tokens} of {tokens} response tokens are NaN or "
                                      f"infinite, actor/entropy: {tokens} of {tokens} response tokens are NaN or "
                                      "infinite")
        assert report["ref_log_prob"] == f"ref/log_prob: {tokens} of {tokens} response tokens are NaN or infinite"
        assert report["values"] == f"critic/values: {tokens} of {tokens} response tokens are NaN or infinite"


def test_only_response_tokens_count():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    log_probs = torch.tensor([[-1.0, float("-inf"), float("nan")], [float("nan"), 0.0, float("inf")]])
    with pytest.raises(Divergence) as raised:
        raise_if_not_finite_tokens({"actor/old_log_prob": log_probs, "actor/entropy": None}, mask)
    assert str(raised.value) == "actor/old_log_prob: 2 of 3 response tokens are NaN or infinite"
    raise_if_not_finite_tokens({"critic/values": torch.where(mask.bool(), 1.0, float("nan"))}, mask)
