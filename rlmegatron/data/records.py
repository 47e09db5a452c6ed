"""The typed prompt record every dataset yields, and the verl-format row it is read from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One prompt, ready for rollout: chat messages, their templated token ids, and what the reward needs."""

    index: int
    """Position in the dataset after filtering; stable across runs with the same files and tokenizer."""
    messages: list[dict[str, str]]
    prompt_ids: list[int]
    """Chat template applied with add_generation_prompt=True."""
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def sample_id(self) -> str:
        """Name used in logs: the source row's `extra_info.index` when given, else the dataset position."""
        return f"{self.data_source}#{self.extra_info.get('index', self.index)}"


def sample_from_row(
    row: dict[str, Any], index: int, prompt_ids: list[int], prompt_key: str = "prompt"
) -> Sample:
    """A Sample from a verl row: {prompt: [messages], data_source, reward_model: {ground_truth}, extra_info}."""
    reward_model = row.get("reward_model") or {}
    return Sample(
        index=index,
        messages=list(row[prompt_key]),
        prompt_ids=list(prompt_ids),
        data_source=str(row.get("data_source", "")),
        ground_truth=reward_model.get("ground_truth"),
        extra_info=dict(row.get("extra_info") or {}),
    )
