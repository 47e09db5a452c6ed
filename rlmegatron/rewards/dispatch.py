"""The default reward: the built-in rule that fits a sample's `data_source`, with verl's signature."""
from __future__ import annotations

from typing import Any, Callable

from rlmegatron.errors import UserError
from rlmegatron.rewards.gsm8k import gsm8k_score
from rlmegatron.rewards.math_reward import math_score

_GSM8K_SOURCES = ("gsm8k",)
# Math competition sets whose answers are boxed: lighteval/MATH, MATH-500, AIME, AMC, NuminaMath, DAPO-Math.
_MATH_SOURCE_WORDS = ("math", "aime", "amc", "numina", "olympiad")


class UnknownDataSource(UserError, ValueError):
    """No built-in reward for a data source; the user should set reward.function."""


def builtin_rule(data_source: str) -> Callable[[str, str], float] | None:
    """The built-in rule, rule(solution_str, ground_truth), that scores `data_source`; None when there is none."""
    source = data_source.lower()
    if any(name in source for name in _GSM8K_SOURCES):
        return gsm8k_score
    if any(word in source for word in _MATH_SOURCE_WORDS):
        return math_score
    return None


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> float:
    """Score a response by the rule its data source implies (the contract of `reward.function`)."""
    rule = builtin_rule(data_source)
    if rule is None:
        raise UnknownDataSource(
            f"no built-in reward for data_source {data_source!r}; set reward.function=path/to/file.py:compute_score"
        )
    return rule(solution_str, str(ground_truth))
