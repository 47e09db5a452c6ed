"""The actor's loss terms: clipped-surrogate policy losses (PPO/DAPO dual-clip, GSPO, with TIS) and the entropy bonus.

Every policy loss has the signature of :data:`PolicyLoss` and returns ``(loss, metrics)``: ``loss``
follows ``aggregation`` (so it can carry a global DP/micro-batch denominator) and ``metrics`` holds
detached token-means over *this* micro-batch:

* ``pg_clipfrac``: share of tokens where the clipped surrogate was the active (larger) loss;
* ``pg_clipfrac_lower``: share of tokens where the dual clip capped a negative-advantage loss;
* ``ppo_kl``: mean of old_log_prob - log_prob, the k1 KL(old || current) estimate.

Truncated importance sampling (TIS, Yao et al. 2025) corrects for the rollout engine and the trainer
disagreeing on log-probs of the same tokens: each token's loss is multiplied by the detached
weight min(exp(old_log_prob - rollout_log_prob), tis_cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlmegatron.algorithms.aggregation import LossAggregation, aggregate_loss
from rlmegatron.algorithms.masked import masked_mean
from rlmegatron.algorithms.registry import Registry

LOG_RATIO_BOUND = 20.0  # token log-ratio clamp before exp(), as verl's vanilla loss
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp on the sequence log-ratio, as verl's gspo loss


@dataclass(frozen=True)
class PolicyLossConfig:
    """Clip ranges and corrections shared by the policy losses.

    ``clip_ratio_low`` / ``clip_ratio_high``: the ratio is clipped to [1 - low, 1 + high]; a larger
    ``high`` is DAPO's clip-higher (e.g. 0.2 / 0.28). ``clip_ratio_c``: dual-clip bound (> 1) capping
    the loss of negative-advantage tokens at -A * c (Ye et al. 2020); ``None`` disables it.
    ``tis_cap``: truncation of the rollout importance weight; ``None`` disables TIS.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be positive, got {self.tis_cap}")


class PolicyLoss(Protocol):
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        config: PolicyLossConfig = ...,
        aggregation: LossAggregation = ...,
        rollout_log_prob: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def truncated_importance_weights(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, tis_cap: float
) -> torch.Tensor:
    """Detached TIS weight min(exp(old_log_prob - rollout_log_prob), tis_cap) per token."""
    return (old_log_prob - rollout_log_prob).detach().exp().clamp(max=tis_cap)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig, response_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token max(-A * ratio, -A * clip(ratio)), then the dual clip on A < 0; plus clip fractions."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask)}
    if config.clip_ratio_c is None:
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=loss.device)
        return loss, metrics
    dual_clip_cap = -advantages * config.clip_ratio_c
    negative = advantages < 0
    metrics["pg_clipfrac_lower"] = masked_mean((negative & (loss > dual_clip_cap)).float(), response_mask)
    return torch.where(negative, torch.minimum(loss, dual_clip_cap), loss), metrics


def _finish(
    token_loss: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    aggregation: LossAggregation,
    rollout_log_prob: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Apply TIS, aggregate, and attach ppo_kl: the tail every surrogate loss shares."""
    if config.tis_cap is not None:
        if rollout_log_prob is None:
            raise ValueError("tis_cap is set but no rollout_log_prob was given")
        token_loss = token_loss * truncated_importance_weights(old_log_prob, rollout_log_prob, config.tis_cap)
    metrics["ppo_kl"] = masked_mean((old_log_prob - log_prob).detach(), response_mask)
    return aggregate_loss(token_loss, response_mask, aggregation), {k: v.detach() for k, v in metrics.items()}


@POLICY_LOSSES.register("vanilla", "ppo")
def ppo_clip_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    aggregation: LossAggregation = LossAggregation(),
    rollout_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate on the token ratio pi/pi_old, with asymmetric clip and dual clip (verl's ``vanilla``)."""
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    token_loss, metrics = _clipped_surrogate(log_ratio.exp(), advantages, config, response_mask)
    return _finish(token_loss, metrics, old_log_prob, log_prob, response_mask, config, aggregation, rollout_log_prob)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=None),
    aggregation: LossAggregation = LossAggregation(mode="seq-mean-token-mean"),
    rollout_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): clip the *sequence* ratio s_i = exp(mean_t log(pi/pi_old)), the geometric mean.

    Each token carries s_i * pi_t / sg(pi_t) (GSPO-token with sequence-constant advantages): its
    value is s_i, its gradient s_i * grad log pi_t, so ``seq-mean-token-mean`` aggregation gives
    the paper's sequence-level gradient. The defaults are the paper's clip ranges and that
    aggregation; verl forces that aggregation, we honour the caller's ``aggregation`` so it always
    matches the global denominator the caller computed. verl's GSPO has no dual clip: pass a
    config with ``clip_ratio_c=None`` (as the default does) for parity.
    """
    token_log_ratio = log_prob - old_log_prob
    sequence_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).detach().unsqueeze(-1)
    combined_log_ratio = (sequence_log_ratio + log_prob - log_prob.detach()).clamp(max=GSPO_LOG_RATIO_MAX)
    token_loss, metrics = _clipped_surrogate(combined_log_ratio.exp(), advantages, config, response_mask)
    return _finish(token_loss, metrics, old_log_prob, log_prob, response_mask, config, aggregation, rollout_log_prob)


def entropy_bonus(
    token_entropy: torch.Tensor,
    response_mask: torch.Tensor,
    entropy_coeff: float,
    aggregation: LossAggregation = LossAggregation(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus as a loss term: returns (-entropy_coeff * aggregated entropy, metrics).

    The first element is *added* to the loss (minimising it raises entropy).
    ``metrics["entropy"]`` is the detached token-mean entropy of this micro-batch.
    """
    loss_term = -entropy_coeff * aggregate_loss(token_entropy, response_mask, aggregation)
    return loss_term, {"entropy": masked_mean(token_entropy.detach(), response_mask)}
