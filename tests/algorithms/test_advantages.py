"""Advantage estimators against hand-computed cases and their defining formulas.

verl counterparts (verl.trainer.ppo.core_algos): gae -> compute_gae_advantage_return,
grpo -> compute_grpo_outcome_advantage, rloo -> compute_rloo_outcome_advantage,
reinforce_plus_plus -> compute_reinforce_plus_plus_outcome_advantage,
reinforce_plus_plus_baseline -> compute_reinforce_plus_plus_baseline_outcome_advantage,
remax -> compute_remax_outcome_advantage, opo -> compute_opo_outcome_advantage,
gpg -> compute_gpg_outcome_advantage (whose alpha counts nonzero scores; ours is the paper's).
"""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from rlmegatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    gae_advantages,
    gpg_advantages,
    grpo_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)

from .batches import outcome_rewards, random_mask

T = torch.tensor


def _f64(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------- GAE


def test_gae_by_hand_with_a_multi_turn_hole():
    """Mirrors verl's compute_gae_advantage_return, which also skips masked (observation) tokens."""
    rewards = _f64([[0.0, 0.0, 1.0], [0.0, 5.0, 1.0]])
    values = _f64([[0.2, 0.4, 0.6], [0.5, 7.0, 0.5]])
    mask = _f64([[1, 1, 1], [1, 0, 1]])  # row 1: the middle token is a tool output
    advantages, returns = gae_advantages(rewards, mask, values=values, gamma=0.5, lam=0.5)
    # row 0: t=2 delta = 1 - 0.6 = 0.4, A2 = 0.4
    #        t=1 delta = 0 + 0.5*0.6 - 0.4 = -0.1, A1 = -0.1 + 0.25*0.4 = 0
    #        t=0 delta = 0 + 0.5*0.4 - 0.2 = 0, A0 = 0 + 0.25*0 = 0
    # row 1: t=2 delta = 1 - 0.5 = 0.5, A2 = 0.5; t=1 is skipped (A and V carried)
    #        t=0 delta = 0 + 0.5*0.5 - 0.5 = -0.25, A0 = -0.25 + 0.25*0.5 = -0.125
    raw = _f64([[0.0, 0.0, 0.4], [-0.125, 0.0, 0.5]])
    # returns = raw + values on valid tokens: [0.2, 0.4, 1.0], [0.375, -, 1.0]
    assert_close(returns, _f64([[0.2, 0.4, 1.0], [0.375, 0.0, 1.0]]))
    # whitening over the 5 valid raws: mean 0.775/5 = 0.155; squared deviations
    # .024025 + .024025 + .060025 + .0784 + .119025 = .3055, unbiased var .3055/4 = .076375
    expected = (raw - 0.155) / math.sqrt(0.076375 + 1e-8) * mask
    assert_close(advantages, expected)


def _textbook_gae(rewards, values, mask, gamma, lam):
    """GAE on each sequence's valid tokens only, with V after the last one = 0."""
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        index = mask[i].nonzero().flatten().tolist()
        running, next_value = 0.0, 0.0
        for t in reversed(index):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            running = delta + gamma * lam * running
            next_value = values[i, t]
            advantages[i, t] = running
    return advantages


def test_gae_matches_the_textbook_recursion_on_random_inputs():
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    values = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    mask = random_mask(6, 8, generator, holes=True)
    mask[0, :4] = 1.0
    advantages, returns = gae_advantages(rewards, mask, values=values, gamma=0.9, lam=0.8)
    raw = _textbook_gae(rewards, values, mask, 0.9, 0.8)
    valid = mask.bool()
    assert_close(returns, (raw + values) * mask)
    selected = raw[valid]
    assert_close(advantages[valid], (selected - selected.mean()) / (selected.var() + 1e-8).sqrt())
    assert advantages[~valid].abs().sum().item() == 0.0


# ---------------------------------------------------------------- group estimators

GROUPS = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)  # verl passes string uids
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
LENGTHS = [3, 1, 2, 2, 3, 1]


def _outcome_batch():
    mask = (torch.arange(3).unsqueeze(0) < T(LENGTHS).unsqueeze(1)).double()
    return outcome_rewards(T(SCORES), mask), mask


def _broadcast(per_sequence, mask):
    return _f64(per_sequence).unsqueeze(-1) * mask


def test_grpo_by_hand():
    """Mirrors verl's compute_grpo_outcome_advantage (eps 1e-6, unbiased std, singleton -> mean 0 / std 1)."""
    rewards, mask = _outcome_batch()
    advantages, returns = grpo_advantages(rewards, mask, group_index=GROUPS)
    # group a: scores 1, 0, 0 -> mean 1/3; deviations 2/3, -1/3, -1/3, squares sum 6/9,
    #          unbiased var (6/9)/2 = 1/3, std = 0.57735
    # group b: scores 1, 1 -> mean 1, std 0 -> advantages 0 / (0 + 1e-6) = 0
    # group c: one sample -> mean 0, std 1 -> 0.5 / (1 + 1e-6)
    scale_a = 1.0 / (math.sqrt(1.0 / 3.0) + 1e-6)
    expected = [(2 / 3) * scale_a, (-1 / 3) * scale_a, (-1 / 3) * scale_a, 0.0, 0.0, 0.5 / (1 + 1e-6)]
    assert_close(advantages, _broadcast(expected, mask))
    assert torch.equal(returns, advantages)  # verl returns the advantages as returns for GRPO


def test_dr_grpo_skips_the_std():
    rewards, mask = _outcome_batch()
    advantages, _ = grpo_advantages(rewards, mask, group_index=GROUPS, norm_adv_by_std=False)
    # score - group mean: a: 1 - 1/3, 0 - 1/3, 0 - 1/3; b: 0, 0; c: 0.5 - 0
    assert_close(advantages, _broadcast([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.5], mask))


def test_rloo_by_hand():
    """Mirrors verl's compute_rloo_outcome_advantage (a group of one keeps its raw score)."""
    rewards, mask = _outcome_batch()
    advantages, _ = rloo_advantages(rewards, mask, group_index=GROUPS)
    # a: 1 - (0 + 0)/2 = 1; 0 - (1 + 0)/2 = -0.5 (twice); b: 1 - 1 = 0 (twice); c: 0.5
    assert_close(advantages, _broadcast([1.0, -0.5, -0.5, 0.0, 0.0, 0.5], mask))


def test_group_index_may_be_a_list_an_int_array_or_a_tensor():
    rewards, mask = _outcome_batch()
    reference, _ = grpo_advantages(rewards, mask, group_index=GROUPS)
    for index in (list(GROUPS), np.array([7, 7, 7, 2, 2, 9]), T([7, 7, 7, 2, 2, 9])):
        assert_close(grpo_advantages(rewards, mask, group_index=index)[0], reference)
    with pytest.raises(ValueError, match="group_index has 2 entries for 6 sequences"):
        grpo_advantages(rewards, mask, group_index=["a", "b"])


def _random_groups(generator):
    group_sizes = [4, 1, 3, 2]
    index = np.repeat(np.arange(len(group_sizes)), group_sizes)[torch.randperm(10, generator=generator).numpy()]
    mask = random_mask(10, 5, generator, allow_empty=False)
    scores = torch.randn(10, generator=generator, dtype=torch.float64)
    return index, outcome_rewards(scores, mask), mask, scores


def test_group_estimators_match_their_formulas_on_random_inputs():
    generator = torch.Generator().manual_seed(4)
    index, rewards, mask, scores = _random_groups(generator)
    grpo, rloo, dr_grpo = [], [], []
    for i in range(10):
        group = scores[torch.from_numpy(index == index[i])]
        others = scores[torch.from_numpy((index == index[i]) & (np.arange(10) != i))]
        if group.numel() == 1:
            grpo.append(scores[i] / (1 + 1e-6))
            dr_grpo.append(scores[i])
            rloo.append(scores[i])
        else:
            grpo.append((scores[i] - group.mean()) / (group.std() + 1e-6))
            dr_grpo.append(scores[i] - group.mean())
            rloo.append(scores[i] - others.mean())
    assert_close(grpo_advantages(rewards, mask, group_index=index)[0], torch.stack(grpo).unsqueeze(-1) * mask)
    assert_close(
        grpo_advantages(rewards, mask, group_index=index, norm_adv_by_std=False)[0],
        torch.stack(dr_grpo).unsqueeze(-1) * mask,
    )
    assert_close(rloo_advantages(rewards, mask, group_index=index)[0], torch.stack(rloo).unsqueeze(-1) * mask)

    baseline = torch.stack(dr_grpo).unsqueeze(-1) * mask  # score - group mean, 0 mean for a singleton
    tokens = baseline[mask.bool()]
    expected = (baseline - tokens.mean()) / (tokens.var() + 1e-8).sqrt() * mask
    assert_close(reinforce_plus_plus_baseline_advantages(rewards, mask, group_index=index)[0], expected)


def test_gpg_by_hand():
    """GPG (Chu et al. 2025, F_norm = 1): alpha * (score - group mean), alpha = B / (B - M)."""
    rewards, mask = _outcome_batch()
    advantages, returns = gpg_advantages(rewards, mask, group_index=GROUPS)
    # B = 6 sequences; group b (1, 1) is all equal, so M = 2 and alpha = 6 / 4 = 1.5.
    # a: 1.5 * (1 - 1/3) = 1, 1.5 * (0 - 1/3) = -0.5 (twice); b: 0, 0; c (alone, mean 0): 1.5 * 0.5 = 0.75
    assert_close(advantages, _broadcast([1.0, -0.5, -0.5, 0.0, 0.0, 0.75], mask))
    assert torch.equal(returns, advantages)
    # Every group varied: M = 0, alpha = 1, and GPG is Dr. GRPO's score - mean.
    varied = outcome_rewards(T([1.0, 0.0, 0.0, 1.0, 0.0, 0.5]), mask)
    assert_close(gpg_advantages(varied, mask, group_index=GROUPS)[0],
                 grpo_advantages(varied, mask, group_index=GROUPS, norm_adv_by_std=False)[0])


def test_opo_by_hand():
    """OPO (Hao et al. 2025): score minus the length-weighted group mean sum_j l_j r_j / sum_j l_j."""
    rewards, mask = _outcome_batch()
    advantages, returns = opo_advantages(rewards, mask, group_index=GROUPS)
    # a: lengths 3, 1, 2 and scores 1, 0, 0 -> baseline 3 / 6 = 0.5 -> 0.5, -0.5, -0.5
    # b: lengths 2, 3 and scores 1, 1 -> baseline 5 / 5 = 1 -> 0, 0; c: alone, baseline 0 -> 0.5
    assert_close(advantages, _broadcast([0.5, -0.5, -0.5, 0.0, 0.0, 0.5], mask))
    assert torch.equal(returns, advantages)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gpg", "opo", "reinforce_plus_plus_baseline"])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(estimator):
    """Rewards of 0.1 in float32: the group mean is exact in float64, so score - mean is exactly 0."""
    group = 8
    scores = torch.full((group,), 0.1, dtype=torch.float32)
    # The teeth: accumulated in float32, the mean of eight 0.1s is not 0.1, and GRPO's 1/(std + 1e-6)
    # would turn that 7e-9 into an advantage of about -0.007 for every sample.
    float32_mean = torch.zeros(1).index_add_(0, torch.zeros(group, dtype=torch.long), scores) / group
    assert (scores - float32_mean).abs().max() > 0
    mask = torch.ones(group, 3)
    advantages, _ = compute_advantages(estimator, outcome_rewards(scores, mask), mask, group_index=[0] * group)
    assert advantages.dtype == torch.float32
    assert torch.equal(advantages, torch.zeros_like(advantages))


# ---------------------------------------------------------------- REINFORCE++, ReMax


def test_reinforce_plus_plus_by_hand():
    """Mirrors verl's compute_reinforce_plus_plus_outcome_advantage on right-padded responses."""
    rewards = _f64([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = _f64([[1, 1, 1], [1, 1, 0]])
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # row 0: G2 = 1, G1 = 0 + 0.5*1 = 0.5, G0 = 0.25; row 1: G1 = 2, G0 = 0 + 0.5*2 = 1
    assert_close(returns, _f64([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    # whitening over 0.25, 0.5, 1, 1, 2: mean 4.75/5 = 0.95; squared deviations
    # .49 + .2025 + .0025 + .0025 + 1.1025 = 1.8, unbiased var 1.8/4 = 0.45
    assert_close(advantages, (returns - 0.95) / math.sqrt(0.45 + 1e-8) * mask)


def test_reinforce_plus_plus_carries_the_return_through_a_hole():
    # verl resets the running return at the masked token, giving G0 = 0; we carry it: G0 = 0.5 * 1
    rewards, mask = _f64([[0.0, 0.0, 1.0]]), _f64([[1, 0, 1]])
    _, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    assert_close(returns, _f64([[0.5, 0.0, 1.0]]))


def test_reinforce_plus_plus_matches_the_discounted_return_on_random_inputs():
    generator = torch.Generator().manual_seed(5)
    rewards = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    mask = random_mask(5, 7, generator)
    mask[0, :3] = 1.0
    _, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.9)
    expected = torch.zeros_like(rewards)
    for i in range(5):
        for t in range(int(mask[i].sum())):
            expected[i, t] = sum(0.9 ** (k - t) * rewards[i, k] for k in range(t, int(mask[i].sum())))
    assert_close(returns, expected)


def test_reinforce_plus_plus_baseline_by_hand():
    rewards = _f64([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    mask = _f64([[1, 1], [1, 0], [1, 0]])
    advantages, _ = reinforce_plus_plus_baseline_advantages(rewards, mask, group_index=["a", "a", "b"])
    # scores 1, 0, 2; group a mean 0.5 -> 0.5, -0.5; b is alone -> mean 0 -> 2
    # token values 0.5, 0.5, -0.5, 2: mean 2.5/4 = 0.625; squared deviations
    # .015625 + .015625 + 1.265625 + 1.890625 = 3.1875, unbiased var 3.1875/3 = 1.0625
    tokens = _f64([[0.5, 0.5], [-0.5, 0.0], [2.0, 0.0]])
    assert_close(advantages, (tokens - 0.625) / math.sqrt(1.0625 + 1e-8) * mask)


def test_remax_by_hand():
    """Mirrors verl's compute_remax_outcome_advantage: reward-to-go minus the greedy baseline."""
    rewards = _f64([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = _f64([[1, 1, 1], [1, 1, 0]])
    advantages, returns = remax_advantages(rewards, mask, reward_baselines=_f64([0.5, 1.0]))
    # reward-to-go: row 0 = 1 everywhere, row 1 = 2 on its two tokens; minus baselines 0.5 / 1
    assert_close(returns, _f64([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    assert_close(advantages, _f64([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]))


# ---------------------------------------------------------------- shared properties and dispatch


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_is_masked_shaped_and_gradient_free(estimator):
    generator = torch.Generator().manual_seed(6)
    index, rewards, mask, _ = _random_groups(generator)
    rewards.requires_grad_(True)
    advantages, returns = compute_advantages(
        estimator,
        rewards,
        mask,
        values=torch.randn(10, 5, generator=generator, dtype=torch.float64),
        group_index=index,
        reward_baselines=torch.randn(10, generator=generator, dtype=torch.float64),
        gamma=0.9,
        lam=0.95,
    )
    for result in (advantages, returns):
        assert result.shape == mask.shape and not result.requires_grad
        assert result[~mask.bool()].abs().sum().item() == 0.0


def test_compute_advantages_forwards_options_and_demands_required_inputs():
    rewards, mask = _outcome_batch()
    assert_close(
        compute_advantages("grpo", rewards, mask, group_index=GROUPS, norm_adv_by_std=False)[0],
        grpo_advantages(rewards, mask, group_index=GROUPS, norm_adv_by_std=False)[0],
    )
    with pytest.raises(ValueError, match="'gae' needs 'values'"):
        compute_advantages("gae", rewards, mask, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="'rloo' needs 'group_index'"):
        compute_advantages("rloo", rewards, mask)


PLUGIN_ESTIMATOR = """
def centred(token_level_rewards, response_mask, group_index, gamma=0.5):
    # group_index by position-or-keyword name, gamma defaulted but supplied
    scores = (token_level_rewards * response_mask).sum(-1)
    advantage = (scores - scores.mean()) * gamma
    return advantage.unsqueeze(-1) * response_mask, scores.unsqueeze(-1) * response_mask
"""


def test_compute_advantages_runs_a_plugin_with_the_inputs_it_names(tmp_path):
    (tmp_path / "my_estimators.py").write_text(PLUGIN_ESTIMATOR)
    reference = f"{tmp_path / 'my_estimators.py'}:centred"
    rewards, mask = _outcome_batch()
    advantages, returns = compute_advantages(reference, rewards, mask, group_index=GROUPS, gamma=0.25, lam=0.9)
    # scores 1, 0, 0, 1, 1, 0.5: mean 3.5 / 6; times gamma 0.25 (lam is not among its inputs)
    expected = [(score - 3.5 / 6) * 0.25 for score in SCORES]
    assert_close(advantages, _broadcast(expected, mask))
    assert_close(returns, _broadcast(SCORES, mask))
    with pytest.raises(ValueError, match="needs 'group_index'"):
        compute_advantages(reference, rewards, mask)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_sees_a_multi_turn_response_as_its_model_tokens_alone(estimator):
    """A multi-turn response's tool answers are holes in its mask (0 between model tokens): on the model tokens,
    every estimator gives what it gives on the same responses with the holes cut out, and 0 in the holes."""
    generator = torch.Generator().manual_seed(5)
    model_tokens = [3, 5, 2, 4, 4, 1]
    holes = [[1, 2], [0, 3, 3], [], [2], [1, 1, 1], []]  # hole lengths after model tokens 1, 2, ...
    width = max(m + sum(h) for m, h in zip(model_tokens, holes))
    holed, compact = torch.zeros(6, width), torch.zeros(6, max(model_tokens))
    columns = []
    for row, (count, row_holes) in enumerate(zip(model_tokens, holes)):
        position, kept = 0, []
        for token in range(count):
            kept.append(position)
            position += 1 + (row_holes[token] if token < len(row_holes) else 0)
        columns.append(kept)
        holed[row, kept] = 1.0
        compact[row, :count] = 1.0
    scores = torch.rand(6, generator=generator, dtype=torch.float64)
    values_compact = torch.randn(6, compact.shape[1], generator=generator, dtype=torch.float64)
    values_holed = torch.zeros(6, width, dtype=torch.float64)
    for row, kept in enumerate(columns):
        values_holed[row, kept] = values_compact[row, : len(kept)]
    inputs = dict(group_index=np.array(["a", "a", "a", "b", "b", "b"], dtype=object),
                  reward_baselines=torch.rand(6, generator=generator, dtype=torch.float64), gamma=0.9, lam=0.8)
    holed_advantages, holed_returns = compute_advantages(estimator, outcome_rewards(scores, holed.double()),
                                                         holed.double(), values=values_holed, **inputs)
    compact_advantages, compact_returns = compute_advantages(estimator, outcome_rewards(scores, compact.double()),
                                                             compact.double(), values=values_compact, **inputs)
    for row, kept in enumerate(columns):
        assert_close(holed_advantages[row, kept], compact_advantages[row, : len(kept)])
        assert_close(holed_returns[row, kept], compact_returns[row, : len(kept)])
    assert holed_advantages[holed == 0].abs().sum() == 0 and holed_returns[holed == 0].abs().sum() == 0
