"""Rollout correction (TIS, MIS, rejection, veto) on a batch whose ratios are chosen by hand.

Row 0 has token ratios pi_old / pi_rollout = 2, 0.5, 3 (sequence ratio 3, geometric mean 3^(1/3) = 1.442);
row 1 has 1, 4 and a padding column (sequence ratio 4, geometric mean 2).
"""
import math

import pytest
import torch
from torch.testing import assert_close

from rlmegatron.algorithms import RolloutCorrectionConfig, rollout_correction

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
RATIOS = torch.tensor([[2.0, 0.5, 3.0], [1.0, 4.0, 9.0]])  # the 9 is padding and must change nothing
ROLLOUT = torch.full((2, 3), -1.0)
OLD = RATIOS.log() + ROLLOUT


def correct(**config):
    return rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(**config))


@pytest.mark.parametrize("level, mode, threshold, weights, capped", [
    ("token", "truncate", 2.5, [[2.0, 0.5, 2.5], [1.0, 2.5, 0.0]], 2 / 5),
    ("token", "mask", 2.5, [[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]], 2 / 5),
    ("sequence", "truncate", 3.5, [[3.0, 3.0, 3.0], [3.5, 3.5, 0.0]], 1 / 2),
    ("sequence", "mask", 3.5, [[3.0, 3.0, 3.0], [0.0, 0.0, 0.0]], 1 / 2),
])
def test_importance_weights_by_hand(level, mode, threshold, weights, capped):
    corrected = correct(rollout_is=level, rollout_is_mode=mode, rollout_is_threshold=threshold)
    assert_close(corrected.weights, torch.tensor(weights))
    assert_close(corrected.response_mask, MASK)  # weighting rejects nothing
    assert corrected.metrics["rollout_corr/is_capped_fraction"] == pytest.approx(capped)
    kept = torch.tensor(weights)[MASK.bool()]
    assert corrected.metrics["rollout_corr/is_weight_mean"] == pytest.approx(float(kept.mean()))
    assert "rollout_corr/rejected_token_fraction" not in corrected.metrics


@pytest.mark.parametrize("config, mask, tokens, sequences", [
    # Outside [1/2.5, 2.5]: the 3 and the 4.
    (dict(rollout_rs="token", rollout_rs_threshold=2.5), [[1, 1, 0], [1, 0, 0]], 2 / 5, 2 / 2),
    # Sequence ratios 3 and 4 against [1/3.5, 3.5]: row 1 goes.
    (dict(rollout_rs="sequence", rollout_rs_threshold=3.5), [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),
    # An explicit lower bound of 3.2 rejects row 0's 3 instead... and row 1's 4 is above 3.5.
    (dict(rollout_rs="sequence", rollout_rs_threshold=3.5, rollout_rs_threshold_lower=3.2),
     [[0, 0, 0], [0, 0, 0]], 5 / 5, 2 / 2),
    # Geometric means 1.442 and 2 against [2/3, 1.5]: row 1 goes.
    (dict(rollout_rs="geometric", rollout_rs_threshold=1.5), [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),
])
def test_rejection_by_hand(config, mask, tokens, sequences):
    corrected = correct(**config)
    assert corrected.weights is None
    assert_close(corrected.response_mask, torch.tensor(mask, dtype=torch.float32))
    assert corrected.metrics["rollout_corr/rejected_token_fraction"] == pytest.approx(tokens)
    assert corrected.metrics["rollout_corr/rejected_seq_fraction"] == pytest.approx(sequences)


def test_the_veto_rejects_a_whole_sequence_for_one_token():
    corrected = correct(rollout_token_veto_threshold=0.6)  # row 0's 0.5
    assert_close(corrected.response_mask, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert corrected.metrics["rollout_corr/veto_fraction"] == 0.5
    assert corrected.metrics["rollout_corr/rejected_token_fraction"] == pytest.approx(3 / 5)
    # A ratio that underflows float32 once exponentiated (log-ratio -120) is still caught.
    rollout = ROLLOUT.clone()
    rollout[1, 0] = 119.0
    vetoed = rollout_correction(OLD, rollout, MASK, RolloutCorrectionConfig(rollout_token_veto_threshold=1e-40))
    assert_close(vetoed.response_mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_rejected_tokens_carry_no_importance_weight():
    corrected = correct(rollout_is="token", rollout_is_threshold=2.5, rollout_rs="token", rollout_rs_threshold=2.5)
    assert_close(corrected.weights, torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]]))
    assert corrected.metrics["rollout_corr/is_capped_fraction"] == 0.0  # the capped tokens were rejected first


def test_the_ratio_distribution_and_mismatch_kl_by_hand():
    metrics = correct(rollout_is="token").metrics
    ratios = [2.0, 0.5, 3.0, 1.0, 4.0]
    assert metrics["rollout_corr/token_ratio_mean"] == pytest.approx(10.5 / 5)
    assert metrics["rollout_corr/token_ratio_std"] == pytest.approx(float(torch.tensor(ratios).std(unbiased=False)))
    assert (metrics["rollout_corr/token_ratio_min"], metrics["rollout_corr/token_ratio_max"]) == pytest.approx((0.5, 4))
    assert metrics["rollout_corr/seq_ratio_mean"] == pytest.approx(3.5)
    assert (metrics["rollout_corr/seq_ratio_min"], metrics["rollout_corr/seq_ratio_max"]) == pytest.approx((3, 4))
    # k1 = mean(-log r) = -log(12) / 5; k3 = mean(r - 1 - log r) = (10.5 - 5 - log 12) / 5
    assert metrics["rollout_corr/mismatch_kl_k1"] == pytest.approx(-math.log(12) / 5, rel=1e-5)
    assert metrics["rollout_corr/mismatch_kl_k3"] == pytest.approx((5.5 - math.log(12)) / 5, rel=1e-5)


def test_bounds_that_cross_are_refused():
    with pytest.raises(ValueError, match="must be below rollout_rs_threshold"):
        RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=2.0)
    assert not RolloutCorrectionConfig().enabled


def test_the_policy_mismatch_is_the_probability_gap_and_the_kl_of_the_sampled_tokens():
    """Worked by hand: p_old 0.5 and 0.2 against p_rollout 0.4 and 0.2 (a third token outside the mask): gaps 0.1 and
    0; KL(rollout || old) by k3 with r = 1.25 and 1: (0.25 - ln 1.25 + 0) / 2."""
    from rlmegatron.algorithms import policy_mismatch

    old, rollout = torch.tensor([[0.5, 0.2, 0.9]]).log(), torch.tensor([[0.4, 0.2, 0.5]]).log()
    metrics = policy_mismatch(old, rollout, torch.tensor([[1.0, 1.0, 0.0]]))
    assert metrics == pytest.approx({"training/rollout_probs_diff_mean": 0.05, "training/rollout_probs_diff_max": 0.1,
                                     "training/rollout_kl": (0.25 - math.log(1.25)) / 2}, rel=1e-6)
    assert policy_mismatch(old, rollout, torch.zeros(1, 3)) == {}
