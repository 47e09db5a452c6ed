"""KL estimators, the KL loss term, KL-in-reward and its controllers.

verl counterparts: estimators -> verl.trainer.ppo.core_algos.kl_penalty; controllers ->
FixedKLController / AdaptiveKLController; apply_kl_penalty -> verl.trainer.ppo.ray_trainer.apply_kl_penalty.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from rlmegatron.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
)

LN2 = math.log(2.0)


@pytest.mark.parametrize(
    "name, p, ref, expected",
    [
        # log p/ref = ln 2 = 0.693147
        ("k1", 0.5, 0.25, LN2),
        ("abs", 0.5, 0.25, LN2),
        ("k2", 0.5, 0.25, 0.5 * LN2**2),  # 0.240227
        ("k3", 0.5, 0.25, 0.5 - 1 + LN2),  # r = ref/p = 0.5: r - 1 - ln r = 0.193147
        # log p/ref = -ln 2
        ("k1", 0.25, 0.5, -LN2),
        ("abs", 0.25, 0.5, LN2),
        ("k2", 0.25, 0.5, 0.5 * LN2**2),
        ("k3", 0.25, 0.5, 2 - 1 - LN2),  # r = 2: 0.306853
    ],
)
def test_estimators_by_hand(name, p, ref, expected):
    value = KL_ESTIMATORS.get(name)(torch.tensor([math.log(p)]), torch.tensor([math.log(ref)]))
    assert_close(value, torch.tensor([expected]))


def test_aliases_follow_verl_names():
    assert KL_ESTIMATORS.get("kl") is KL_ESTIMATORS.get("k1")
    assert KL_ESTIMATORS.get("mse") is KL_ESTIMATORS.get("k2")
    assert KL_ESTIMATORS.get("low_var_kl") is KL_ESTIMATORS.get("k3")


def test_k3_is_clamped_to_ten_with_finite_gradients():
    log_prob = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    # r = e^30, e^-30, e^-100; without the inner clamp e^100 would overflow and poison the gradient
    ref = torch.tensor([30.0, -30.0, -100.0])
    value = KL_ESTIMATORS.get("k3")(log_prob, ref)
    value.sum().backward()
    assert_close(value, torch.tensor([10.0, 10.0, 10.0]))
    assert torch.isfinite(log_prob.grad).all()


def test_unbiased_estimators_average_to_the_exact_kl():
    """E_{x~p}[k1] = E_{x~p}[k3] = KL(p || q), computed exactly over a categorical support."""
    generator = torch.Generator().manual_seed(13)
    p = torch.softmax(torch.randn(50, generator=generator, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(50, generator=generator, dtype=torch.float64), 0)
    exact = (p * (p / q).log()).sum()
    for name in ("k1", "k3"):
        assert_close((p * KL_ESTIMATORS.get(name)(p.log(), q.log())).sum(), exact)
    assert (KL_ESTIMATORS.get("k2")(p.log(), q.log()) >= 0).all()


def test_kl_loss_by_hand():
    log_prob = torch.tensor([[math.log(0.5), 0.0, 5.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    term, metrics = kl_loss(log_prob, ref, mask, kl_coef=0.5, kl_type="k1")
    # k1 per token: ln 2, 0 (the masked 5 is ignored); token-mean ln2 / 2; times 0.5 -> ln2 / 4
    assert_close(term, torch.tensor(LN2 / 4))
    assert_close(metrics["kl_loss"], torch.tensor(LN2 / 2))
    term.backward()
    assert_close(log_prob.grad, torch.tensor([[0.25, 0.25, 0.0]]))


def test_adaptive_controller_by_hand():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    controller.update(current_kl=0.06, n_steps=10)  # error 0.06/0.05 - 1 = 0.2 -> * (1 + 0.2 * 10/100) = 1.02
    assert controller.value == pytest.approx(0.102)
    controller.update(current_kl=0.5, n_steps=10)  # error 9 clipped to 0.2 -> * 1.02
    assert controller.value == pytest.approx(0.10404)
    controller.update(current_kl=0.0, n_steps=50)  # error -1 clipped to -0.2 -> * (1 - 0.2 * 50/100) = 0.9
    assert controller.value == pytest.approx(0.093636)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.05, 0)


def test_fixed_controller_never_moves():
    controller = FixedKLController(kl_coef=0.3)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.3


def _penalty_batch():
    scores = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    old = torch.tensor([[math.log(0.5), math.log(0.5)], [math.log(0.5), 9.0]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)], [math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return scores, old, ref, mask


def test_apply_kl_penalty_by_hand():
    scores, old, ref, mask = _penalty_batch()
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, FixedKLController(0.1), kl_type="kl")
    # k1 = [[ln2, 0], [0, (masked)]]; rewards = scores - 0.1 * k1
    assert_close(rewards, torch.tensor([[-0.1 * LN2, 1.0], [2.0, 0.0]]))
    # per-sequence token-mean KL: ln2/2 and 0 -> batch mean ln2/4 = 0.173287
    assert_close(metrics["kl"], torch.tensor(LN2 / 4))
    assert_close(metrics["kl_coef"], torch.tensor(0.1))


def test_apply_kl_penalty_advances_an_adaptive_controller_by_batch_size():
    scores, old, ref, mask = _penalty_batch()
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    _, metrics = apply_kl_penalty(scores, old, ref, mask, controller, kl_type="kl")
    # error ln2/4 / 0.1 - 1 = 0.73 -> clipped 0.2; n_steps = batch size 2: * (1 + 0.2 * 2/10) = 1.04
    assert controller.value == pytest.approx(0.104)
    assert_close(metrics["kl_coef"], torch.tensor(0.1))  # the coefficient used, before the update
