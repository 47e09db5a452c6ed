"""On-policy distillation (algorithm.distill): the student samples, a frozen teacher scores each sampled token, and
the per-token divergence between the two is the learning signal, as a dense advantage.

With ``mode: reverse_kl`` a response token's advantage is ``-coef * (log p_student - log p_teacher)``: the one-sample
estimate (k1) of the reverse KL(student || teacher) at that token, negated, so the policy gradient lowers the
student's probability where it exceeds the teacher's and raises it where the teacher's is higher. Reverse KL is
mode-seeking and needs only the log-prob of the token sampled, never the teacher's whole distribution (the
formulation of Agarwal et al. 2024, and of slime's, NeMo-RL's and TRL's on-policy distillation).
"""
from __future__ import annotations

import torch

from rlmegatron.algorithms.kl import KL_ESTIMATORS, KLEstimator
from rlmegatron.algorithms.masked import masked_mean, zero_outside_mask
from rlmegatron.algorithms.registry import Registry

# Each mode: the per-token divergence the advantage is minus coef times, from the sampled tokens' log-probs.
DISTILL_MODES: Registry[KLEstimator] = Registry("distillation mode")
DISTILL_MODES.register("reverse_kl")(KL_ESTIMATORS.get("k1"))


def distill_advantages(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       coef: float, mode: str = "reverse_kl") -> tuple[torch.Tensor, dict[str, float]]:
    """(advantages [B, R], metrics): -coef x the per-token divergence on the response tokens, 0 elsewhere; the
    divergence's and the teacher log-prob's means over the response tokens as distill/reverse_kl and
    distill/teacher_logp_mean. ``student_log_probs``: the sampling policy's log-probs of the sampled tokens."""
    with torch.no_grad():
        divergence = zero_outside_mask(DISTILL_MODES.get(mode)(student_log_probs, teacher_log_probs), response_mask)
        metrics = {"distill/reverse_kl": float(masked_mean(divergence, response_mask)),
                   "distill/teacher_logp_mean": float(masked_mean(teacher_log_probs, response_mask))}
        return -coef * divergence, metrics
