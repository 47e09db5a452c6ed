"""Policy-vs-reference KL: per-token estimators, the actor's KL loss term, KL-in-reward and its controllers.

All estimators take per-token log-probs of the *sampled* tokens, ``log_prob`` under the policy that
generated them and ``ref_log_prob`` under the reference, and estimate KL(policy || reference)
(Schulman, "Approximating KL divergence", 2020). With log r = ref_log_prob - log_prob:

* ``k1`` / ``kl``: -log r; unbiased, high variance, can be negative per token.
* ``k2`` / ``mse``: (log r)^2 / 2; biased, low variance, always >= 0.
* ``k3`` / ``low_var_kl``: r - 1 - log r; unbiased, low variance, >= 0; clamped to [-10, 10] as verl does.
* ``abs``: |log r|.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlmegatron.algorithms.aggregation import LossAggregation, aggregate_loss
from rlmegatron.algorithms.masked import masked_mean, zero_outside_mask
from rlmegatron.algorithms.registry import Registry

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

K3_LOG_RATIO_BOUND = 20.0  # keeps exp() finite so the clamped branch cannot produce 0 * inf = NaN grads
K3_VALUE_BOUND = 10.0


@KL_ESTIMATORS.register("k1", "kl")
def k1_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("k2", "mse")
def k2_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_log_prob - log_prob).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (log_ratio.exp() - 1 - log_ratio).clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)


@KL_ESTIMATORS.register("abs")
def abs_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_type: str = "low_var_kl",
    aggregation: LossAggregation = LossAggregation(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a loss term (the actor's ``use_kl_loss``): returns (kl_coef * aggregated KL, metrics).

    The first element is added to the policy loss as is. ``metrics["kl_loss"]`` is the detached
    token-mean KL of this micro-batch, independent of the aggregation's global normalisation.
    """
    token_kl = KL_ESTIMATORS.get(kl_type)(log_prob, ref_log_prob)
    loss_term = kl_coef * aggregate_loss(token_kl, response_mask, aggregation)
    return loss_term, {"kl_loss": masked_mean(token_kl.detach(), response_mask)}


class FixedKLController:
    """KL-in-reward coefficient that never changes."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op, so fixed and adaptive controllers are interchangeable."""


class AdaptiveKLController:
    """Ziegler et al. (2019) proportional controller steering the observed KL towards ``target_kl``.

    Each update multiplies the coefficient by 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward: token rewards = scores - beta * KL(old policy || ref) on valid tokens.

    Returns the rewards and ``{"kl": batch mean of per-sequence token-mean KL, "kl_coef": beta}``,
    beta being the coefficient *used* here. Like verl, it then advances ``kl_ctrl`` by one update
    with ``n_steps`` = batch size; that is this function's only side effect.
    """
    token_kl = zero_outside_mask(KL_ESTIMATORS.get(kl_type)(old_log_prob, ref_log_prob), response_mask)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * token_kl
    current_kl = masked_mean(token_kl, response_mask, dim=-1).mean()
    kl_ctrl.update(current_kl=current_kl.item(), n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"kl": current_kl, "kl_coef": torch.tensor(beta)}
