"""The actor's loss terms: policy losses (PPO/DAPO, GSPO, GPG, CISPO, Clip-Cov, KL-Cov) and the entropy bonus.

Every policy loss has the signature of :class:`PolicyLoss` and returns ``(loss, metrics)``: ``loss``
follows ``aggregation`` (so it can carry a global DP/micro-batch denominator) and ``metrics`` holds
detached scalars over *this* micro-batch. The built-in losses all report

* ``pg_clipfrac``: share of tokens whose loss a clip changed (for Clip-Cov: whose gradient it dropped);
* ``pg_clipfrac_lower``: share of tokens where the dual clip capped a negative-advantage loss;
* ``ppo_kl``: mean of old_log_prob - log_prob, the k1 KL(old || current) estimate, computed from
  the same (clamped) log-ratio the loss uses.

A user's loss (``actor.policy_loss.loss_mode: path/to/file.py:function``) follows the same
protocol; its metrics, whatever their names, are logged as ``actor/<name>``.

Rollout correction (rlmegatron.algorithms.rollout_correction: truncated or masked importance sampling, per
token or per sequence) reaches a loss as ``rollout_is_weights``: every built-in loss multiplies each token's
loss by that detached weight before aggregating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from rlmegatron.algorithms.aggregation import LossAggregation, aggregate_loss
from rlmegatron.algorithms.masked import mask_count, masked_mean
from rlmegatron.algorithms.registry import Registry

LOG_RATIO_BOUND = 20.0  # token log-ratio clamp before exp(), as verl's vanilla loss
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp on the sequence log-ratio, as verl's gspo loss


@dataclass(frozen=True)
class PolicyLossConfig:
    """Clip ranges and corrections shared by the policy losses; each loss reads only some of them.

    ``clip_ratio_low`` / ``clip_ratio_high``: the ratio is clipped to [1 - low, 1 + high]; a larger
    ``high`` is DAPO's clip-higher (e.g. 0.2 / 0.28). ``clip_ratio_c``: dual-clip bound (> 1) capping
    the loss of negative-advantage tokens at -A * c (Ye et al. 2020); ``None`` disables it.
    ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``: Clip-Cov's share of tokens to drop and the
    covariance window they are drawn from. ``kl_cov_ratio``, ``ppo_kl_coef``: KL-Cov's share of
    tokens to penalise and the weight of that penalty. The defaults are verl's.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    def __post_init__(self) -> None:
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a share of tokens in (0, 1], got {getattr(self, name)}")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})")
        if self.ppo_kl_coef < 0.0:
            raise ValueError(f"ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")


class PolicyLoss(Protocol):
    """How the actor calls a policy loss: four [batch, resp_len] tensors, then these keywords."""

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        config: PolicyLossConfig = ...,
        aggregation: LossAggregation = ...,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


POLICY_LOSS_POSITIONAL = ("old_log_prob", "log_prob", "advantages", "response_mask")
POLICY_LOSS_KEYWORDS = ("config", "aggregation", "rollout_is_weights")

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _policy_loss(*names: str, reads: tuple[str, ...]) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a built-in loss under ``names``, recording the PolicyLossConfig fields it reads."""

    def decorator(loss: PolicyLoss) -> PolicyLoss:
        loss.config_fields = frozenset(reads)
        return POLICY_LOSSES.register(*names)(loss)

    return decorator


def config_fields_read(loss: PolicyLoss) -> frozenset[str] | None:
    """The PolicyLossConfig fields ``loss`` reads; None for a user's loss, which may read any of them."""
    return getattr(loss, "config_fields", None)


def _clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    response_mask: torch.Tensor,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token max(-A * ratio, -A * clip(ratio)), then a dual clip at ``dual_clip`` on A < 0; and clip fractions."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask)}
    if dual_clip is None:
        return loss, metrics
    dual_clip_cap = -advantages * dual_clip
    negative = advantages < 0
    metrics["pg_clipfrac_lower"] = masked_mean((negative & (loss > dual_clip_cap)).float(), response_mask)
    return torch.where(negative, torch.minimum(loss, dual_clip_cap), loss), metrics


def _finish(
    token_loss: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    aggregation: LossAggregation,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weigh by the rollout correction, aggregate, and attach ppo_kl from the loss's own ``log_ratio``: the tail
    every loss shares."""
    if rollout_is_weights is not None:
        token_loss = token_loss * rollout_is_weights.detach()
    zero = torch.zeros((), device=token_loss.device)
    metrics = {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, **metrics}
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), response_mask)
    return aggregate_loss(token_loss, response_mask, aggregation), {k: v.detach() for k, v in metrics.items()}


@_policy_loss("vanilla", "ppo", reads=("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"))
def ppo_clip_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    aggregation: LossAggregation = LossAggregation(),
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate on the token ratio pi/pi_old, with asymmetric clip and dual clip (verl's ``vanilla``)."""
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    token_loss, metrics = _clipped_surrogate(log_ratio.exp(), advantages, config, response_mask, config.clip_ratio_c)
    return _finish(token_loss, metrics, log_ratio, response_mask, aggregation, rollout_is_weights)


@_policy_loss("gspo", reads=("clip_ratio_low", "clip_ratio_high"))
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4),
    aggregation: LossAggregation = LossAggregation(mode="seq-mean-token-mean"),
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): clip the *sequence* ratio s_i = exp(mean_t log(pi/pi_old)), the geometric mean.

    Each token carries s_i * pi_t / sg(pi_t) (GSPO-token with sequence-constant advantages): its
    value is s_i, its gradient s_i * grad log pi_t, so ``seq-mean-token-mean`` aggregation gives
    the paper's sequence-level gradient. The defaults are the paper's clip ranges and that
    aggregation; verl forces that aggregation, we honour the caller's ``aggregation`` so it always
    matches the global denominator the caller computed. There is no dual clip, as in the paper
    and verl: ``config.clip_ratio_c`` is not read.
    """
    token_log_ratio = log_prob - old_log_prob
    sequence_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).detach().unsqueeze(-1)
    combined_log_ratio = (sequence_log_ratio + log_prob - log_prob.detach()).clamp(max=GSPO_LOG_RATIO_MAX)
    token_loss, metrics = _clipped_surrogate(combined_log_ratio.exp(), advantages, config, response_mask, None)
    return _finish(
        token_loss, metrics, token_log_ratio, response_mask, aggregation, rollout_is_weights
    )


@_policy_loss("gpg", reads=())
def gpg_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    aggregation: LossAggregation = LossAggregation(),
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (Chu et al. 2025): the plain policy gradient -A * log pi, no ratio and no clip.

    The paper's objective is the token mean; like verl we follow ``aggregation``. ``ppo_kl`` is the
    unclamped log-ratio, as the loss has no ratio to clamp.
    """
    token_loss = -advantages * log_prob
    log_ratio = log_prob - old_log_prob
    return _finish(token_loss, {}, log_ratio, response_mask, aggregation, rollout_is_weights)


@_policy_loss("cispo", reads=("clip_ratio_low", "clip_ratio_high"))
def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    aggregation: LossAggregation = LossAggregation(),
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - low, 1 + high)) * A * log pi.

    The clip bounds the importance weight, not the update: every token keeps its gradient A * w *
    grad log pi, where PPO's clip would zero it. ``pg_clipfrac`` is the share of tokens whose
    weight was clipped.
    """
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    token_loss = -weight * advantages * log_prob
    metrics = {"pg_clipfrac": masked_mean((weight != ratio).float(), response_mask)}
    return _finish(token_loss, metrics, log_ratio, response_mask, aggregation, rollout_is_weights)


def _centred_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-token (A - mean A)(log pi - mean log pi), means over the valid tokens (Cui et al.'s covariance)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, valid)) * (log_prob - masked_mean(log_prob, valid))


def _share_of(valid: torch.Tensor, ratio: float) -> int:
    """max(1, floor(ratio * valid tokens)): how many tokens a covariance loss acts on, as in verl."""
    return max(int(ratio * int(mask_count(valid))), 1)


@_policy_loss("clip_cov", reads=("clip_ratio_low", "clip_ratio_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
def clip_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    aggregation: LossAggregation = LossAggregation(),
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025): PPO's clipped surrogate with a few high-covariance tokens' loss set to 0.

    Among the valid tokens that PPO's clip left alone and whose covariance (A - mean A)(log pi -
    mean log pi) lies strictly inside (clip_cov_lb, clip_cov_ub), max(1, floor(clip_cov_ratio *
    valid tokens)) drawn at random lose their loss and so their gradient, which slows the entropy
    collapse those tokens drive. No dual clip, as in the paper and verl. The selection is made per
    micro-batch, as verl does. The draw uses a generator seeded from the candidates' positions: every
    tensor-parallel rank computes this loss on the same tokens and must drop the same ones, and a
    rerun drops them again.
    """
    valid = response_mask.bool()
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    covariance = _centred_covariance(advantages, log_prob, valid)
    candidates = valid & ~(clipped > unclipped) & (covariance > config.clip_cov_lb) & (covariance < config.clip_cov_ub)
    positions = candidates.flatten().nonzero().squeeze(-1).cpu()
    generator = torch.Generator().manual_seed((int(positions.sum()) * 1_000_003 + len(positions)) % 2**63)
    chosen = positions[torch.randperm(len(positions), generator=generator)[: _share_of(valid, config.clip_cov_ratio)]]
    keep = torch.ones(valid.numel(), dtype=ratio.dtype)
    keep[chosen] = 0.0
    keep = keep.view_as(ratio).to(ratio.device)
    token_loss = torch.maximum(unclipped, clipped) * keep
    metrics = {"pg_clipfrac": masked_mean((keep == 0).float(), response_mask)}
    return _finish(token_loss, metrics, log_ratio, response_mask, aggregation, rollout_is_weights)


@_policy_loss("kl_cov", reads=("kl_cov_ratio", "ppo_kl_coef"))
def kl_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    aggregation: LossAggregation = LossAggregation(),
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025): the unclipped surrogate -A * r, plus ppo_kl_coef * |log r| on the top tokens.

    The max(1, floor(kl_cov_ratio * valid tokens)) valid tokens of largest covariance
    (A - mean A)(log pi - mean log pi) get the KL penalty, which restrains the updates that collapse
    entropy; no token is clipped. The selection is made per micro-batch, as verl does.
    """
    valid = response_mask.bool()
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    token_loss = -advantages * log_ratio.exp()
    if valid.any():
        covariance = _centred_covariance(advantages, log_prob, valid).masked_fill(~valid, -torch.inf)
        top = covariance.flatten().topk(_share_of(valid, config.kl_cov_ratio)).indices
        penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        penalised[top] = True
        penalty = config.ppo_kl_coef * log_ratio.abs()
        token_loss = torch.where(penalised.view_as(valid), token_loss + penalty, token_loss)
    return _finish(token_loss, {}, log_ratio, response_mask, aggregation, rollout_is_weights)


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
