"""Policy losses (PPO with DAPO clip-higher, dual clip, rollout IS weights; GSPO, GPG, CISPO, Clip-Cov, KL-Cov), entropy bonus.

verl counterparts (verl.trainer.ppo.core_algos): ``vanilla`` -> compute_policy_loss_vanilla
(clip_ratio_low/high, clip_ratio_c, rollout_is_weights), ``gspo`` -> compute_policy_loss_gspo,
``gpg`` -> compute_policy_loss_gpg, ``cispo`` -> compute_policy_loss_cispo, ``clip_cov`` ->
compute_policy_loss_clip_cov, ``kl_cov`` -> compute_policy_loss_kl_cov (their ``ppo_kl`` is mean |log r|;
ours stays the k1 estimate every loss reports), entropy -> the actor's agg_loss(entropy) * entropy_coeff.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from rlmegatron.algorithms import (
    POLICY_LOSSES,
    LossAggregation,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    cispo_policy_loss,
    clip_cov_policy_loss,
    config_fields_read,
    entropy_bonus,
    gpg_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_clip_policy_loss,
    rollout_correction,
)

from .batches import random_mask

DAPO = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
RATIOS = [1.5, 0.5, 0.9, 4.0, 1.0]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 5.0]
MASK = [1.0, 1.0, 1.0, 1.0, 0.0]  # the last token is padding with a garbage advantage


def _hand_batch():
    old = torch.full((1, 5), -1.0, dtype=torch.float64)
    new = (old + torch.tensor([RATIOS], dtype=torch.float64).log()).requires_grad_(True)
    return old, new, torch.tensor([ADVANTAGES], dtype=torch.float64), torch.tensor([MASK], dtype=torch.float64)


def test_ppo_dual_clip_clip_higher_by_hand():
    old, new, advantages, mask = _hand_batch()
    loss, metrics = ppo_clip_policy_loss(old, new, advantages, mask, DAPO)
    # token 0: r 1.5, A +1: max(-1.5, -clip(1.5, 0.8, 1.28) = -1.28) = -1.28   (clipped)
    # token 1: r 0.5, A +1: max(-0.5, -0.8) = -0.5
    # token 2: r 0.9, A -1: max(0.9, 0.9) = 0.9; dual cap -A*c = 3 not reached
    # token 3: r 4.0, A -1: max(4.0, 1.28) = 4.0; dual clip min(4.0, 3) = 3   (lower-clipped)
    # token-mean: (-1.28 - 0.5 + 0.9 + 3) / 4 = 2.12 / 4 = 0.53
    assert_close(loss, torch.tensor(0.53, dtype=torch.float64))
    assert_close(metrics["pg_clipfrac"], torch.tensor(0.25))
    assert_close(metrics["pg_clipfrac_lower"], torch.tensor(0.25))
    # ppo_kl = mean(old - new) = -mean(log r) = -ln(1.5 * 0.5 * 0.9 * 4) / 4 = -ln(2.7) / 4
    assert_close(metrics["ppo_kl"], torch.tensor(-math.log(2.7) / 4, dtype=torch.float64))
    loss.backward()
    # d/dlog r of -A*r is -A*r on unclipped tokens, 0 on clipped ones; / 4 tokens:
    # [0, -0.5/4, 0.9/4, 0, 0]
    assert_close(new.grad, torch.tensor([[0.0, -0.125, 0.225, 0.0, 0.0]], dtype=torch.float64))


def test_ppo_without_dual_clip():
    old, new, advantages, mask = _hand_batch()
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    loss, metrics = ppo_clip_policy_loss(old, new, advantages, mask, config)
    # token 3 keeps its 4.0: (-1.28 - 0.5 + 0.9 + 4.0) / 4 = 0.78
    assert_close(loss, torch.tensor(0.78, dtype=torch.float64))
    assert metrics["pg_clipfrac_lower"].item() == 0.0


def test_rollout_importance_weights_scale_each_tokens_loss_by_hand():
    old, new, advantages, mask = _hand_batch()
    weights = torch.tensor([[0.5, 2.0, 1.0, 1.5, 7.0]], dtype=torch.float64, requires_grad=True)
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    loss, _ = ppo_clip_policy_loss(old, new, advantages, mask, config, rollout_is_weights=weights)
    # (-1.28*0.5 - 0.5*2 + 0.9*1 + 4.0*1.5) / 4 = (-0.64 - 1 + 0.9 + 6) / 4 = 5.26 / 4 = 1.315 (padding's 7 unused)
    assert_close(loss, torch.tensor(1.315, dtype=torch.float64))
    loss.backward()
    assert weights.grad is None  # the weight is a detached constant


def test_ppo_kl_uses_the_losss_clamped_log_ratio():
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[25.0, -1.0]], dtype=torch.float64)
    advantages, mask = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    _, metrics = ppo_clip_policy_loss(old, new, advantages, mask, DAPO)
    # The loss sees log r clamped to [-20, 20]: 20 and -1, so ppo_kl = -(20 - 1) / 2, not -(25 - 1) / 2.
    assert_close(metrics["ppo_kl"], torch.tensor(-9.5, dtype=torch.float64))
    _, metrics = cispo_policy_loss(old, new, advantages, mask, DAPO)
    assert_close(metrics["ppo_kl"], torch.tensor(-9.5, dtype=torch.float64))


def test_config_validation():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_cov_ratio is a share of tokens"):
        PolicyLossConfig(clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov_ratio is a share of tokens"):
        PolicyLossConfig(kl_cov_ratio=1.5)
    with pytest.raises(ValueError, match="clip_cov_lb .* must be below clip_cov_ub"):
        PolicyLossConfig(clip_cov_lb=5.0)
    with pytest.raises(ValueError, match="ppo_kl_coef must be >= 0"):
        PolicyLossConfig(ppo_kl_coef=-1.0)


def _random_policy_batch(seed, batch=6, resp_len=7):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, resp_len, generator=generator, dtype=torch.float64) * 3
    new = (old + 0.6 * torch.randn(batch, resp_len, generator=generator, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.randn(batch, resp_len, generator=generator, dtype=torch.float64)
    mask = random_mask(batch, resp_len, generator, holes=True)
    mask[0, :2] = 1.0
    rollout = old + 0.3 * torch.randn(batch, resp_len, generator=generator, dtype=torch.float64)
    return old, new, advantages, mask, rollout


def test_ppo_matches_the_sign_split_formula_on_random_inputs():
    """Independent form: A >= 0 -> -A min(r, 1+h); A < 0 -> -A min(max(r, 1-l), c); times the TIS weight."""
    old, new, advantages, mask, rollout = _random_policy_batch(7)
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    weights = rollout_correction(old, rollout, mask, RolloutCorrectionConfig("token", rollout_is_threshold=1.5)).weights
    loss, metrics = ppo_clip_policy_loss(old, new, advantages, mask, config, rollout_is_weights=weights)
    loss.backward()
    grad = new.grad.clone()

    reference_new = new.detach().clone().requires_grad_(True)
    ratio = (reference_new - old).exp()
    positive = -advantages * torch.minimum(ratio, torch.tensor(1.28, dtype=torch.float64))
    negative = -advantages * torch.clamp(torch.maximum(ratio, torch.tensor(0.8, dtype=torch.float64)), max=3.0)
    tis = torch.clamp((old - rollout).exp(), max=1.5)
    per_token = torch.where(advantages >= 0, positive, negative) * tis
    reference = per_token[mask.bool()].mean()
    reference.backward()
    assert_close(loss, reference)
    assert_close(grad, reference_new.grad)
    assert_close(metrics["ppo_kl"], (old - new.detach())[mask.bool()].mean())


def test_gspo_by_hand():
    """Mirrors verl's compute_policy_loss_gspo (sequence ratio, seq-mean-token-mean)."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.1, -0.3, 9.0], [0.3, 0.3, 0.3]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None)
    loss, metrics = gspo_policy_loss(old, new, advantages, mask, config)
    # seq 0: mean log ratio (0.1 - 0.3)/2 = -0.1, s0 = e^-0.1 = 0.904837 inside [0.8, 1.2]: loss -0.904837
    # seq 1: mean log ratio 0.3, s1 = e^0.3 = 1.349859 > 1.2, A = 2: max(-2.699718, -2.4) = -2.4 (clipped)
    # seq-mean-token-mean: (-0.904837 - 2.4) / 2
    assert_close(loss, torch.tensor((-math.exp(-0.1) - 2.4) / 2, dtype=torch.float64))
    assert_close(metrics["pg_clipfrac"], torch.tensor(3 / 5))  # the 3 tokens of seq 1
    assert_close(metrics["ppo_kl"], torch.tensor(-(0.1 - 0.3 + 0.9) / 5, dtype=torch.float64))
    loss.backward()
    # seq 0 tokens: d/dlogp_t [ (1/2 seqs) * (1/2 tokens) * -A * s0 * pi_t/sg(pi_t) ] = -s0 / 4; seq 1 is clipped
    quarter = -math.exp(-0.1) / 4
    assert_close(new.grad, torch.tensor([[quarter, quarter, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64))


def test_gspo_matches_the_sequence_level_objective_on_random_inputs():
    """GSPO's definition: mean_i max(-A_i s_i, -A_i clip(s_i)) with s_i = exp(mean_t log(pi/pi_old)).

    Autograd runs through s_i itself here, so the gradient check validates the token-level rewrite.
    """
    old, new, _, mask, _ = _random_policy_batch(8)
    mask[:, 0] = 1.0  # every sequence non-empty
    sequence_advantage = torch.randn(6, 1, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    advantages = sequence_advantage.expand(6, 7)
    config = PolicyLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.08, clip_ratio_c=None)
    loss, _ = gspo_policy_loss(old, new, advantages, mask, config)
    loss.backward()
    grad = new.grad.clone()

    reference_new = new.detach().clone().requires_grad_(True)
    log_ratio = (reference_new - old) * mask
    s = (log_ratio.sum(-1) / mask.sum(-1)).exp()
    a = sequence_advantage.squeeze(-1)
    reference = torch.maximum(-a * s, -a * s.clamp(0.95, 1.08)).mean()
    reference.backward()
    assert_close(loss, reference)
    assert_close(grad, reference_new.grad)


def test_gspo_has_no_dual_clip():
    """A negative-advantage sequence with s = e^2 = 7.39 > clip_ratio_c = 3 keeps its loss -A * s."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.full((1, 2), 2.0, dtype=torch.float64, requires_grad=True)
    advantages, mask = -torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    loss, metrics = gspo_policy_loss(old, new, advantages, mask, PolicyLossConfig(clip_ratio_c=3.0))
    # max(-A s, -A clip(s, 0.8, 1.2)) = max(7.389, 1.2) = e^2; a dual clip would have capped it at 3.
    assert_close(loss, torch.tensor(math.exp(2.0), dtype=torch.float64))
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    # Gradient of s * pi_t / sg(pi_t) on each token: s / 2 tokens (seq-mean-token-mean of one sequence)
    assert_close(new.grad, torch.full((1, 2), math.exp(2.0) / 2, dtype=torch.float64))


def test_gspo_equals_ppo_when_every_sequence_has_one_token():
    old, new, advantages, mask, _ = _random_policy_batch(10, resp_len=1)
    mask[:] = 1.0
    config = PolicyLossConfig(clip_ratio_c=None)
    aggregation = LossAggregation("seq-mean-token-mean")
    gspo, _ = gspo_policy_loss(old, new, advantages, mask, config, aggregation)
    ppo, _ = ppo_clip_policy_loss(old, new, advantages, mask, config, aggregation)
    assert_close(gspo, ppo)


def test_gpg_by_hand():
    """GPG's loss is the policy gradient itself: -A * log pi, here token-mean."""
    log_prob = torch.tensor([[-1.0, -2.0, -0.5, 7.0]], dtype=torch.float64, requires_grad=True)
    old = log_prob.detach() - 0.3
    advantages = torch.tensor([[1.0, -2.0, 4.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, metrics = gpg_policy_loss(old, log_prob, advantages, mask)
    # (-(1)(-1) - (-2)(-2) - (4)(-0.5)) / 3 = (1 - 4 + 2) / 3 = -1/3
    assert_close(loss, torch.tensor(-1.0 / 3.0, dtype=torch.float64))
    assert_close(metrics["ppo_kl"], torch.tensor(-0.3, dtype=torch.float64))
    assert metrics["pg_clipfrac"].item() == 0.0
    loss.backward()
    assert_close(log_prob.grad, torch.tensor([[-1.0 / 3, 2.0 / 3, -4.0 / 3, 0.0]], dtype=torch.float64))


def test_cispo_by_hand():
    """CISPO: -sg(clip(r, 1 - low, 1 + high)) * A * log pi; clipped tokens keep their gradient."""
    old, new, advantages, mask = _hand_batch()
    loss, metrics = cispo_policy_loss(old, new, advantages, mask, DAPO)
    # r = 1.5, 0.5, 0.9, 4.0 -> weights clip(r, 0.8, 1.28) = 1.28, 0.8, 0.9, 1.28; A = 1, 1, -1, -1
    # log pi = -1 + log r; loss = mean(-w * A * log pi)
    weights, log_pi = [1.28, 0.8, 0.9, 1.28], [-1 + math.log(r) for r in RATIOS[:4]]
    expected = sum(-w * a * lp for w, a, lp in zip(weights, ADVANTAGES, log_pi)) / 4
    assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert_close(metrics["pg_clipfrac"], torch.tensor(0.75))  # 1.5, 0.5 and 4.0 were clipped
    loss.backward()
    # d/dlog pi = -w * A / 4, nonzero on the clipped tokens too (PPO gives tokens 0 and 3 zero gradient)
    expected_grad = [-w * a / 4 for w, a in zip(weights, ADVANTAGES)] + [0.0]
    assert_close(new.grad, torch.tensor([expected_grad], dtype=torch.float64))


def _covariance_batch():
    """One sequence whose token covariances (A - mean A)(log pi - mean log pi) are 3, 0, 0, 0, 6."""
    advantages = torch.tensor([[3.0, 1.0, 1.0, 1.0, -6.0]], dtype=torch.float64)  # mean 0
    log_prob = torch.tensor([[-1.0, -2.0, -2.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)  # mean -2
    return advantages, log_prob, torch.ones(1, 5, dtype=torch.float64)


def test_clip_cov_by_hand():
    advantages, log_prob, mask = _covariance_batch()
    config = PolicyLossConfig(clip_cov_ratio=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0)
    loss, metrics = clip_cov_policy_loss(log_prob.detach(), log_prob, advantages, mask, config)
    # r = 1 everywhere, so PPO clips nothing. Covariance window (1, 5) holds token 0 (3) but not
    # token 4 (6); max(1, floor(0.2 * 5)) = 1 token is dropped: token 0.
    # Loss -A * r on the rest: (0 - 1 - 1 - 1 + 6) / 5 = 0.6
    assert_close(loss, torch.tensor(0.6, dtype=torch.float64))
    assert_close(metrics["pg_clipfrac"], torch.tensor(0.2))
    loss.backward()
    assert_close(log_prob.grad, torch.tensor([[0.0, -0.2, -0.2, -0.2, 1.2]], dtype=torch.float64))


def test_clip_cov_leaves_tokens_that_ppo_clipped_alone():
    advantages, log_prob, mask = _covariance_batch()
    old = log_prob.detach() - torch.tensor([[math.log(1.5), 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    config = PolicyLossConfig(clip_cov_ratio=0.2)
    loss, metrics = clip_cov_policy_loss(old, log_prob, advantages, mask, config)
    # Token 0 (r = 1.5, A = 3) is PPO-clipped, so no candidate remains: plain PPO, max(-4.5, -3 * 1.2) = -3.6
    assert metrics["pg_clipfrac"].item() == 0.0
    assert_close(loss, torch.tensor((-3.6 - 1 - 1 - 1 + 6) / 5, dtype=torch.float64))


def test_clip_cov_draws_its_share_from_the_window_reproducibly():
    generator = torch.Generator().manual_seed(12)
    advantages = torch.randn(8, 50, generator=generator, dtype=torch.float64)
    log_prob = -torch.rand(8, 50, generator=generator, dtype=torch.float64) * 4
    mask = torch.ones(8, 50, dtype=torch.float64)
    config = PolicyLossConfig(clip_cov_ratio=0.01, clip_cov_lb=0.5, clip_cov_ub=2.0)

    def dropped():
        grad_log_prob = log_prob.clone().requires_grad_(True)
        loss, _ = clip_cov_policy_loss(log_prob, grad_log_prob, advantages, mask, config)
        loss.backward()
        return grad_log_prob.grad == 0

    covariance = (advantages - advantages.mean()) * (log_prob - log_prob.mean())
    window = (covariance > 0.5) & (covariance < 2.0)
    first = dropped()
    assert first.sum().item() == 4  # floor(0.01 * 400)
    assert window.sum().item() > 4 and bool(window[first].all())  # a draw from a larger window
    assert torch.equal(dropped(), first)  # the same tokens every time: TP ranks agree


def test_kl_cov_by_hand():
    advantages, log_prob, mask = _covariance_batch()
    old = log_prob.detach() - torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.5]], dtype=torch.float64)
    config = PolicyLossConfig(kl_cov_ratio=0.2, ppo_kl_coef=1.0)
    loss, metrics = kl_cov_policy_loss(old, log_prob, advantages, mask, config)
    # The max(1, floor(0.2 * 5)) = 1 token of largest covariance is token 4 (6): -A r + 1 * |log r|
    # = 6 e^0.5 + 0.5; the others: -A r = -3, -1, -1, -1. Token mean:
    assert_close(loss, torch.tensor((-6.0 + 6 * math.exp(0.5) + 0.5) / 5, dtype=torch.float64))
    assert_close(metrics["ppo_kl"], torch.tensor(-0.1, dtype=torch.float64))
    loss.backward()
    # d/dlog pi: -A r, plus coef * sign(log r) on token 4
    expected = [-3.0, -1.0, -1.0, -1.0, 6 * math.exp(0.5) + 1.0]
    assert_close(log_prob.grad, torch.tensor([expected], dtype=torch.float64) / 5)
    # Without the penalty it is the plain unclipped surrogate.
    plain, _ = kl_cov_policy_loss(old, log_prob, advantages, mask, PolicyLossConfig(kl_cov_ratio=0.2, ppo_kl_coef=0.0))
    assert_close(plain, torch.tensor((-6.0 + 6 * math.exp(0.5)) / 5, dtype=torch.float64))


# Each PolicyLossConfig field moved away from BASE; with these inputs every one of them matters to
# any loss that reads it, so a loss's loss must change exactly for the fields it declares.
# (91 valid tokens: 15 in the Clip-Cov window of BASE, of which 4 are dropped; 3 tokens past the dual clip.)
BASE = PolicyLossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.2, clip_cov_ub=5.0, kl_cov_ratio=0.3)
MOVED = dict(clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=1.5, clip_cov_ratio=0.1,
             clip_cov_lb=0.6, clip_cov_ub=0.8, kl_cov_ratio=0.6, ppo_kl_coef=2.0)


@pytest.mark.parametrize("name", sorted(set(POLICY_LOSSES.names()) - {"ppo"}))
def test_each_loss_reads_exactly_the_config_fields_it_declares(name):
    """The declarations drive the spec's rejection of settings a loss ignores, so they must be true."""
    loss_fn = POLICY_LOSSES.get(name)
    old, new, advantages, mask, rollout = _random_policy_batch(13, batch=16, resp_len=16)
    new = new.detach() + 0.5 * (new.detach() - old)  # ratios far enough out for every clip to bite
    base_loss, _ = loss_fn(old, new, advantages, mask, BASE)
    changed = set()
    for field, value in MOVED.items():
        moved = PolicyLossConfig(**{**BASE.__dict__, field: value})
        loss, _ = loss_fn(old, new, advantages, mask, moved)
        if not torch.allclose(loss, base_loss, rtol=0, atol=1e-12):
            changed.add(field)
    assert changed == config_fields_read(loss_fn)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_registered_losses_share_one_call_signature(name):
    old, new, advantages, mask, rollout = _random_policy_batch(11)
    denominator = torch.tensor(100)
    aggregation = LossAggregation("token-mean", denominator)
    weights = (old - rollout).exp().clamp(max=2.0)
    loss, metrics = POLICY_LOSSES.get(name)(old, new, advantages, mask, PolicyLossConfig(), aggregation,
                                            rollout_is_weights=weights)
    assert loss.dim() == 0 and loss.requires_grad
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())


def test_entropy_bonus_by_hand():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 8.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    term, metrics = entropy_bonus(entropy, mask, entropy_coeff=0.01)
    # token-mean entropy (1 + 2 + 3)/3 = 2; the loss term is -0.01 * 2
    assert_close(term, torch.tensor(-0.02))
    assert_close(metrics["entropy"], torch.tensor(2.0))
    term.backward()
    # d(-0.01 * mean)/dH = -0.01/3 on valid tokens: minimising the loss raises entropy
    assert_close(entropy.grad, torch.tensor([[-0.01 / 3, -0.01 / 3], [-0.01 / 3, 0.0]]))
    # seq-mean-token-mean: (1.5 + 3) / 2 = 2.25
    term, _ = entropy_bonus(entropy, mask, 1.0, LossAggregation("seq-mean-token-mean"))
    assert_close(term, torch.tensor(-2.25))
