"""Rewards from a learned reward model (`reward.model`), which scores prompt + response in the trainer ranks, alone
or combined with the rule-based manager's scores: a weighted sum, or a user's combiner plug-in."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rlmegatron.plugins import PluginError, load_plugin
from rlmegatron.rewards.manager import NaiveRewardManager, NonFiniteReward, RewardFunctionError, RewardInput
from rlmegatron.rewards.manager import RewardResult

# (model_score, rule_score, item) -> reward
Combiner = Callable[[float, float, RewardInput], float]


def sequence_encoder(policy_tokenizer: Any, model_tokenizer: Any) -> Callable[[RewardInput], list[int]]:
    """Token ids of prompt + response as the reward model reads them: the policy's own when the two tokenizers and
    chat templates agree, else the model's chat template (chat prompts) or its tokenizer (plain prompts) over the
    texts."""
    if (model_tokenizer.get_vocab() == policy_tokenizer.get_vocab()
            and getattr(model_tokenizer, "chat_template", None) == getattr(policy_tokenizer, "chat_template", None)):
        return lambda item: list(item.token_ids)

    def encode(item: RewardInput) -> list[int]:
        if isinstance(item.prompt, list):
            messages = [*item.prompt, {"role": "assistant", "content": item.solution_str}]
            text = model_tokenizer.apply_chat_template(messages, tokenize=False)
            return list(model_tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(model_tokenizer(item.prompt + item.solution_str)["input_ids"])

    return encode


class ModelRewardManager:
    """Scores a batch with the reward model (`score_sequences`, one call for the batch) and, when the combination
    reads them, the rule-based manager's scores; the rule manager's shaping (DAPO's overlong penalty) applies to
    the combined score."""

    def __init__(self, rules: NaiveRewardManager, score_sequences: Callable[[list[list[int]]], list[float]],
                 encode: Callable[[RewardInput], list[int]], weight: float = 1.0, rule_weight: float = 0.0,
                 combiner: Combiner | None = None) -> None:
        self.rules, self.score_sequences, self.encode = rules, score_sequences, encode
        self.weight, self.rule_weight, self.combiner = weight, rule_weight, combiner

    @property
    def runs_rules(self) -> bool:
        return self.combiner is not None or self.rule_weight != 0.0

    def __call__(self, items: list[RewardInput]) -> RewardResult:
        model_scores = self.score_sequences([self.encode(item) for item in items])
        ruled = self.rules(items) if self.runs_rules else None
        rule_scores = ruled.scores if ruled is not None else [0.0] * len(items)
        if self.combiner is not None:
            scores = [float(self.combiner(m, r, item)) for m, r, item in zip(model_scores, rule_scores, items)]
        else:
            scores = [self.weight * m + self.rule_weight * r for m, r in zip(model_scores, rule_scores)]
        for item, score, model_score in zip(items, scores, model_scores):
            if not math.isfinite(score):
                raise NonFiniteReward(f"reward.model: sample {item.sample_id} scored {score} "
                                      f"(model score {model_score})")
        rewards, penalty_metrics = self.rules.shape(items, scores)
        metrics = {"reward/model_score/mean": sum(model_scores) / len(model_scores), **penalty_metrics}
        if ruled is not None:
            metrics["reward/rule_score/mean"] = sum(rule_scores) / len(rule_scores)
            metrics.update({k: v for k, v in ruled.metrics.items() if k in ("reward/errors", "reward/timeouts")})
        return RewardResult(rewards, scores, ruled.extra if ruled is not None else {}, metrics)

    def close(self) -> None:
        self.rules.close()


def model_reward_manager(config, rules: NaiveRewardManager, score_sequences: Callable[[list[list[int]]], list[float]],
                         policy_tokenizer: Any) -> ModelRewardManager:
    """The manager for `reward.model` (`config` is the spec's reward section) over the rule-based `rules`."""
    from transformers import AutoTokenizer

    model = config.model
    combiner = None
    if model.combiner is not None:
        try:
            combiner = load_plugin(model.combiner)
        except PluginError as err:
            raise RewardFunctionError(f"reward.model.combiner={model.combiner}: {err}") from None
    encode = sequence_encoder(policy_tokenizer, AutoTokenizer.from_pretrained(model.path))
    return ModelRewardManager(rules, score_sequences, encode, model.weight, model.rule_weight, combiner)
