"""Rollout correction: importance weights and rejection for the rollout policy differing from the trained one.

The engine that sampled a response (SGLang, the local engine; possibly with older weights in asynchronous
training) and the trainer that recomputes its log-probs (``old_log_prob``) do not assign the same probabilities
to the same tokens. Per token the ratio is r_t = pi_old(y_t) / pi_rollout(y_t); per sequence the product
R = prod_t r_t, or its geometric mean G = R^(1/T). This module turns the ratios into

* importance-sampling (IS) weights, per token (r_t) or per sequence (R on each of its tokens), either truncated
  at a cap C (TIS: min(w, C)) or masked above it (MIS: w if w <= C else 0); the policy loss multiplies each
  token's loss by its detached weight;
* rejection sampling (RS): tokens (r_t), sequences (R) or sequences by their geometric mean (G) whose ratio lies
  outside [lower, upper] leave the response mask, so they count in no loss and no denominator;
* an optional veto: a sequence with any token whose ratio falls below a (tiny) threshold is rejected whole, the
  catastrophic-mismatch guard.

The names and meanings follow verl's ``algorithm.rollout_correction``. In asynchronous training the recomputed
``old_log_prob`` is the proximal policy of decoupled PPO (AReaL): the PPO clip anchors on it, and token-level IS
weights move the expectation from the behaviour (rollout) policy to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rlmegatron.algorithms.masked import masked_mean

# Log-ratios are clamped before exp(): a sequence's summed log-ratio easily overflows float32.
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    rollout_is_threshold: float = 2.0
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float | None = None
    """None: 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.rollout_is_threshold <= 0 or self.rollout_rs_threshold <= 0:
            raise ValueError("the IS and RS thresholds must be positive")
        if self.rs_lower >= self.rollout_rs_threshold:
            raise ValueError(f"rollout_rs_threshold_lower ({self.rs_lower}) must be below rollout_rs_threshold "
                             f"({self.rollout_rs_threshold})")

    @property
    def rs_lower(self) -> float:
        return 1.0 / self.rollout_rs_threshold if self.rollout_rs_threshold_lower is None \
            else self.rollout_rs_threshold_lower

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None or \
            self.rollout_token_veto_threshold is not None


@dataclass
class RolloutCorrection:
    weights: torch.Tensor | None
    """[B, R] detached IS weights, zero outside the new mask; None without rollout_is."""
    response_mask: torch.Tensor
    """The response mask less every rejected token."""
    metrics: dict[str, float]


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> RolloutCorrection:
    """IS weights, the mask after rejection, and metrics (``rollout_corr/...``) for one batch of [B, R] tensors."""
    mask = response_mask.bool()
    log_ratio = torch.where(mask, old_log_prob.detach() - rollout_log_prob.detach(), 0.0)
    token_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    sequence_log_ratio = log_ratio.sum(-1)
    sequence_ratio = sequence_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    lengths = mask.sum(-1)
    geometric_ratio = (sequence_log_ratio / lengths.clamp(min=1)).exp()
    has_tokens = lengths > 0

    keep = mask.clone()
    metrics = _ratio_metrics(token_ratio, sequence_ratio, log_ratio, mask, has_tokens)
    if config.rollout_rs is not None:
        lower, upper = config.rs_lower, config.rollout_rs_threshold
        if config.rollout_rs == "token":
            keep &= (token_ratio >= lower) & (token_ratio <= upper)
        else:
            ratio = sequence_ratio if config.rollout_rs == "sequence" else geometric_ratio
            keep &= ((ratio >= lower) & (ratio <= upper)).unsqueeze(-1)
    if config.rollout_token_veto_threshold is not None:
        # Compared in log space: a catastrophic ratio underflows once exponentiated.
        vetoed = (mask & (log_ratio < math.log(config.rollout_token_veto_threshold))).any(-1)
        keep &= ~vetoed.unsqueeze(-1)
        metrics["rollout_corr/veto_fraction"] = _fraction(vetoed, has_tokens)
    if config.rollout_rs is not None or config.rollout_token_veto_threshold is not None:
        rejected = mask & ~keep
        metrics["rollout_corr/rejected_token_fraction"] = _fraction(rejected, mask)
        metrics["rollout_corr/rejected_seq_fraction"] = _fraction(rejected.any(-1), has_tokens)

    weights = None
    if config.rollout_is is not None:
        raw = token_ratio if config.rollout_is == "token" else sequence_ratio.unsqueeze(-1).expand_as(token_ratio)
        over = raw > config.rollout_is_threshold
        capped = raw.clamp(max=config.rollout_is_threshold) if config.rollout_is_mode == "truncate" \
            else torch.where(over, 0.0, raw)
        weights = torch.where(keep, capped, 0.0)
        metrics["rollout_corr/is_capped_fraction"] = (
            _fraction(over, keep) if config.rollout_is == "token"
            else _fraction(sequence_ratio > config.rollout_is_threshold, keep.any(-1)))
        metrics["rollout_corr/is_weight_mean"] = float(masked_mean(weights, keep)) if keep.any() else 0.0
    return RolloutCorrection(weights, keep.to(response_mask.dtype), metrics)


def policy_mismatch(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                    response_mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's probabilities of the sampled tokens are from the engine's, whether or not they are
    corrected (verl's names): |p_rollout - p_old| per response token, its mean and max, and KL(rollout || old)
    estimated on the rollout's samples (k3: mean of r - 1 - log r, r = p_old / p_rollout, never negative)."""
    mask = response_mask.bool()
    if not mask.any():
        return {}
    old, rollout = old_log_probs[mask].double(), rollout_log_probs[mask].double()
    difference = (old.exp() - rollout.exp()).abs()
    log_ratio = (old - rollout).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {
        "training/rollout_probs_diff_mean": float(difference.mean()),
        "training/rollout_probs_diff_max": float(difference.max()),
        "training/rollout_kl": float((log_ratio.exp() - 1 - log_ratio).mean()),
    }


def _fraction(selected: torch.Tensor, among: torch.Tensor) -> float:
    total = int(among.sum())
    return float((selected & among).sum()) / total if total else 0.0


def _ratio_metrics(token_ratio: torch.Tensor, sequence_ratio: torch.Tensor, log_ratio: torch.Tensor,
                   mask: torch.Tensor, has_tokens: torch.Tensor) -> dict[str, float]:
    """The distribution of the token and sequence ratios, and the mismatch KL(rollout || old) estimated on the
    rollout's own samples (k1: mean of log pi_rollout - log pi_old; k3: mean of r - 1 - log r)."""
    if not mask.any():
        return {}
    tokens, sequences, logs = token_ratio[mask], sequence_ratio[has_tokens], log_ratio[mask]
    return {
        "rollout_corr/token_ratio_mean": float(tokens.mean()),
        "rollout_corr/token_ratio_std": float(tokens.std(unbiased=False)),
        "rollout_corr/token_ratio_min": float(tokens.min()),
        "rollout_corr/token_ratio_max": float(tokens.max()),
        "rollout_corr/seq_ratio_mean": float(sequences.mean()),
        "rollout_corr/seq_ratio_min": float(sequences.min()),
        "rollout_corr/seq_ratio_max": float(sequences.max()),
        "rollout_corr/mismatch_kl_k1": float((-logs).mean()),
        "rollout_corr/mismatch_kl_k3": float((tokens - 1 - logs.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).mean()),
    }
