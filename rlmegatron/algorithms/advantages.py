"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, ReMax, GPG, OPO): rewards in, masked (advantages, returns) out.

Both outputs are [batch, resp_len]. Each estimator takes ``(token_level_rewards, response_mask)``
positionally and its own inputs by the standard names of :func:`compute_advantages`
(:data:`ESTIMATOR_INPUTS`), which can therefore feed any registered estimator, or a user's
``path/to/file.py:function`` with the same protocol, from one call site. Results are constants for
the policy update (computed under ``no_grad``) and are 0 wherever ``response_mask`` is 0.

Group statistics are computed in float64 and the advantages cast back to the rewards' dtype: a
group whose rewards are all equal (say 0.1, which float32 cannot hold exactly) then gets
advantages of exactly 0, not rounding noise that the std division would blow up.

Conventions follow verl's ``core_algos`` so a verl user gets the same numbers on right-padded
batches. Where a mask has holes (multi-turn: tool-output tokens inside the response), GAE and
REINFORCE++ both carry their running quantities through the hole undiscounted, as verl's GAE does;
verl's REINFORCE++ instead resets its return at any masked token, which cuts the final reward off
from earlier turns.
"""

from __future__ import annotations

import inspect
from typing import Callable, Hashable, Sequence, Union

import torch

from rlmegatron.algorithms.masked import masked_sum, masked_whiten, zero_outside_mask
from rlmegatron.algorithms.registry import Registry

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# One prompt id per sequence: a tensor, a list, or a numpy array (e.g. verl's string ``uid``s).
GroupIndex = Union[torch.Tensor, Sequence[Hashable]]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")

# What the two positional arguments are called in the protocol, and every input the trainer can
# pass by name; an estimator declares the ones it needs as parameters of these names.
ESTIMATOR_POSITIONAL = ("token_level_rewards", "response_mask")
ESTIMATOR_INPUTS = ("values", "group_index", "reward_baselines", "gamma", "lam", "norm_adv_by_std", "epsilon")


def estimator_inputs(estimate: AdvantageEstimator) -> tuple[str, ...]:
    """The :data:`ESTIMATOR_INPUTS` that ``estimate`` declares (after its two positional parameters)."""
    try:
        names = list(inspect.signature(estimate).parameters)[len(ESTIMATOR_POSITIONAL) :]
    except (TypeError, ValueError):  # a builtin without an introspectable signature declares nothing
        return ()
    return tuple(name for name in names if name in ESTIMATOR_INPUTS)


def _broadcast_over_tokens(
    per_sequence: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[batch] -> [batch, resp_len] on the valid tokens, in ``dtype`` (the rewards' dtype)."""
    per_token = per_sequence.to(dtype).unsqueeze(-1).expand(response_mask.shape)
    return zero_outside_mask(per_token, response_mask)


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome reward per sequence (the sum of its token rewards), in float64 for the group statistics."""
    return masked_sum(token_level_rewards.double(), response_mask, dim=-1)


def dense_group_ids(group_index: GroupIndex, device: torch.device) -> torch.Tensor:
    """Map arbitrary prompt ids to 0..G-1 (int64 on ``device``), preserving which sequences share a group."""
    if isinstance(group_index, torch.Tensor):
        return torch.unique(group_index, return_inverse=True)[1].to(device)
    keys = group_index.tolist() if hasattr(group_index, "tolist") else list(group_index)
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in keys], dtype=torch.long, device=device)


def group_statistics(
    scores: torch.Tensor, group_index: GroupIndex
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group mean, group unbiased std, group size) of ``scores`` [batch], in float64.

    A group of one gets mean 0 and std 1, as verl does: there is nothing to compare against, so
    the raw score passes through rather than becoming a degenerate 0 or 0/0. In float64 the mean
    of n equal float32 scores is exactly that score, so their deviations are exactly 0.
    """
    scores = scores.double()
    ids = dense_group_ids(group_index, scores.device)
    if ids.shape != scores.shape:
        raise ValueError(f"group_index has {ids.numel()} entries for {scores.numel()} sequences")
    sizes = torch.bincount(ids).to(scores.dtype)
    means = torch.zeros_like(sizes).index_add_(0, ids, scores) / sizes
    squared_deviations = torch.zeros_like(sizes).index_add_(0, ids, (scores - means[ids]).square())
    stds = (squared_deviations / (sizes - 1).clamp(min=1)).sqrt()
    size, mean, std = sizes[ids], means[ids], stds[ids]
    grouped = size > 1
    return torch.where(grouped, mean, 0.0), torch.where(grouped, std, 1.0), size


def _masked_backward_recursion(
    token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE recursion A_t = delta_t + gamma*lam*A_{t+1}, delta_t = r_t + gamma*V_{t+1} - V_t, over valid tokens.

    "t+1" is the next *valid* token: masked positions are skipped, carrying A and V through.
    With V = 0 and lam = 1 this is the discounted return-to-go.
    """
    valid = response_mask.bool()
    running_advantage = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        running_advantage = torch.where(valid[:, t], delta + gamma * lam * running_advantage, running_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = running_advantage
    return zero_outside_mask(advantages, response_mask)


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016); returns = raw advantages + values, advantages whitened over the batch."""
    advantages = _masked_backward_recursion(token_level_rewards, values, response_mask, gamma, lam)
    returns = zero_outside_mask(advantages + values, response_mask)
    return masked_whiten(advantages, response_mask), returns


@ADVANTAGE_ESTIMATORS.register("grpo", "gspo")
@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: GroupIndex,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (score - group mean) / (group std + eps), broadcast over tokens.

    ``norm_adv_by_std=False`` drops the std division (Dr. GRPO). Also registered as ``gspo``:
    GSPO (Zheng et al. 2025) keeps GRPO's group-normalised advantage and changes only the
    importance ratio, which lives in the ``gspo`` policy loss.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, std, _ = group_statistics(scores, group_index)
    advantage = scores - mean
    if norm_adv_by_std:
        advantage = advantage / (std + epsilon)
    advantages = _broadcast_over_tokens(advantage, response_mask, token_level_rewards.dtype)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean of the *other* samples of its prompt, = (score - mean) * n / (n - 1).

    A group of one has no other samples, so its raw score is the advantage (verl's convention).
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, size = group_statistics(scores, group_index)
    leave_one_out = (scores - mean) * size / (size - 1).clamp(min=1)
    advantages = _broadcast_over_tokens(leave_one_out, response_mask, token_level_rewards.dtype)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch's valid tokens."""
    returns = _masked_backward_recursion(
        token_level_rewards, torch.zeros_like(token_level_rewards), response_mask, gamma, lam=1.0
    )
    return masked_whiten(returns, response_mask), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus group mean, broadcast over tokens, then whitened over the batch.

    The whitening statistics are token-weighted (a long response counts once per token), as in verl.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, _ = group_statistics(scores, group_index)
    centred = _broadcast_over_tokens(scores - mean, response_mask, torch.float64)
    advantages = masked_whiten(centred, response_mask).to(token_level_rewards.dtype)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("remax")
@torch.no_grad()
def remax_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reward_baselines: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): undiscounted reward-to-go minus the greedy response's reward [batch].

    With an outcome-only reward the reward-to-go is the sequence score at every valid token, so the
    advantage is ``score - baseline`` broadcast over the response.
    """
    rewards = zero_outside_mask(token_level_rewards, response_mask)
    returns = zero_outside_mask(rewards.flip(-1).cumsum(-1).flip(-1), response_mask)
    advantages = returns - _broadcast_over_tokens(reward_baselines, response_mask, returns.dtype)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("gpg")
@torch.no_grad()
def gpg_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): alpha * (score - group mean), with F_norm = 1 and alpha = B / (B - M).

    B counts the batch's sequences and M those in groups whose scores are all equal: such a group
    contributes no gradient, and alpha rescales the rest so the batch's gradient keeps its size
    (the paper's accurate gradient estimation). A group of one keeps its raw score, as in the other
    group estimators, so it is not among the M. (verl's ``gpg`` counts nonzero scores instead.)
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, std, size = group_statistics(scores, group_index)
    zero_gradient = ((size > 1) & (std == 0)).sum()
    alpha = scores.numel() / (scores.numel() - zero_gradient).clamp(min=1)
    advantages = _broadcast_over_tokens(alpha * (scores - mean), response_mask, token_level_rewards.dtype)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("opo")
@torch.no_grad()
def opo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): score minus the length-weighted group mean sum_j l_j r_j / sum_j l_j.

    With exactly on-policy updates that baseline minimises the gradient variance. A group of one
    has baseline 0 (its raw score passes through), as in verl.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    lengths = response_mask.double().sum(dim=-1)
    ids = dense_group_ids(group_index, scores.device)
    _, _, size = group_statistics(scores, group_index)
    weighted = torch.zeros_like(size).index_add_(0, ids, lengths * scores)
    total_length = torch.zeros_like(size).index_add_(0, ids, lengths)
    baseline = torch.where(size > 1, weighted[ids] / total_length[ids].clamp(min=1), 0.0)
    advantages = _broadcast_over_tokens(scores - baseline, response_mask, token_level_rewards.dtype)
    return advantages, advantages


def estimator_options(estimator: str) -> frozenset[str]:
    """The inputs ``estimator`` (a registered name or a plug-in reference) reads, e.g. ``gamma``, ``group_index``."""
    return frozenset(estimator_inputs(ADVANTAGE_ESTIMATORS.resolve(estimator)))


def compute_advantages(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``estimator`` (a registered name or ``path/to/file.py:function``), passing it exactly the inputs it declares.

    A trainer can hand over everything it has; an estimator that needs an input left as ``None``
    fails loudly instead of running on a default.
    """
    estimate = ADVANTAGE_ESTIMATORS.resolve(estimator)
    supplied = {
        "values": values,
        "group_index": group_index,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std": norm_adv_by_std,
        "epsilon": epsilon,
    }
    kwargs = {}
    for name in estimator_inputs(estimate):
        if supplied[name] is not None:
            kwargs[name] = supplied[name]
        elif inspect.signature(estimate).parameters[name].default is inspect.Parameter.empty:
            raise ValueError(f"advantage estimator {estimator!r} needs {name!r}, which was not given")
    return estimate(token_level_rewards, response_mask, **kwargs)
