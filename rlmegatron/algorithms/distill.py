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

from rlmegatron.algorithms.advantages import GroupIndex, dense_group_ids
from rlmegatron.algorithms.kl import KL_ESTIMATORS, KLEstimator
from rlmegatron.algorithms.masked import masked_mean, masked_sum, zero_outside_mask
from rlmegatron.algorithms.registry import Registry

# Each mode: the per-token divergence the advantage is minus coef times, from the sampled tokens' log-probs.
DISTILL_MODES: Registry[KLEstimator] = Registry("distillation mode")
DISTILL_MODES.register("reverse_kl")(KL_ESTIMATORS.get("k1"))


def distill_advantages(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       coef: float, mode: str = "reverse_kl",
                       group_index: GroupIndex | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """(advantages [B, R], metrics): -coef x the per-token divergence on the response tokens, 0 elsewhere; the
    divergence's and the teacher log-prob's means over the response tokens as distill/reverse_kl and
    distill/teacher_logp_mean. ``student_log_probs``: the sampling policy's log-probs of the sampled tokens.

    With ``group_index`` (one prompt id per row) each token's term has its group's mean over the response tokens of
    the prompt's responses subtracted: GRPO's baseline, for the teacher's signal. Far from its teacher a student's
    every sample has a large divergence, and that common part only adds noise to the policy gradient (its expectation
    there is zero); the baseline takes it out."""
    with torch.no_grad():
        divergence = zero_outside_mask(DISTILL_MODES.get(mode)(student_log_probs, teacher_log_probs), response_mask)
        metrics = {"distill/reverse_kl": float(masked_mean(divergence, response_mask)),
                   "distill/teacher_logp_mean": float(masked_mean(teacher_log_probs, response_mask))}
        if group_index is not None:
            groups = dense_group_ids(group_index, divergence.device)
            count = int(groups.max()) + 1
            sums = torch.zeros(count, dtype=torch.float64).index_add_(0, groups, masked_sum(divergence.double(),
                                                                                            response_mask, dim=-1))
            tokens = torch.zeros(count, dtype=torch.float64).index_add_(0, groups,
                                                                        response_mask.double().sum(dim=-1))
            baseline = (sums / tokens.clamp(min=1))[groups].to(divergence.dtype)
            divergence = zero_outside_mask(divergence - baseline[:, None], response_mask)
        return -coef * divergence, metrics
