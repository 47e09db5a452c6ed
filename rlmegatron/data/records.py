"""The typed prompt record every dataset yields, and the row it is read from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlmegatron.data.images import PromptImages


@dataclass(frozen=True)
class Sample:
    """One prompt, ready for rollout: the prompt as the row holds it, its token ids, and what the reward needs."""

    index: int
    """Position in the dataset after filtering; stable across runs with the same files and tokenizer."""
    prompt: list[dict[str, str]] | str
    """Chat messages (data.prompt_format=chat) or the prompt's text (plain)."""
    prompt_ids: list[int]
    """Chat messages: templated with add_generation_prompt=True; a text: tokenized as it is."""
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    images: Optional[PromptImages] = None
    """A vision-language row's images (data.image_key), whose placeholder tokens prompt_ids holds."""

    @property
    def sample_id(self) -> str:
        """Name used in logs: the source row's `extra_info.index` when given, else the dataset position."""
        return f"{self.data_source}#{self.extra_info.get('index', self.index)}"


def sample_from_row(
    row: dict[str, Any], index: int, prompt: list[dict[str, str]] | str, prompt_ids: list[int], ground_truth: Any,
    images: Optional[PromptImages] = None,
) -> Sample:
    """A Sample from a row's prompt and ground truth (read where the data config says) and its optional verl
    columns data_source and extra_info."""
    return Sample(
        index=index,
        prompt=list(prompt) if isinstance(prompt, list) else prompt,
        prompt_ids=list(prompt_ids),
        data_source=str(row.get("data_source", "")),
        ground_truth=ground_truth,
        extra_info=dict(row.get("extra_info") or {}),
        images=images,
    )
