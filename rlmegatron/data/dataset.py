"""The built-in prompt dataset: verl-format rows from parquet or jsonl, chat-templated and length-filtered."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlmegatron.plugins import load_plugin
from rlmegatron.data.records import Sample, sample_from_row

if TYPE_CHECKING:
    from rlmegatron.config.spec import DataConfig

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A data file that cannot be used; the message starts with file:line (jsonl) or file:row (parquet)."""


class PromptDataset(Protocol):
    """What the trainer needs of a dataset, built-in or custom (`data.dataset_class`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


class RLDataset:
    """Prompts of one or more verl-format files; a custom `data.dataset_class` takes the same arguments."""

    def __init__(self, files: Sequence[str], tokenizer: Any, config: DataConfig) -> None:
        self.files = list(files)
        self.prompt_key = config.prompt_key
        self.max_prompt_length = config.max_prompt_length
        self.samples: list[Sample] = []
        overlong: list[str] = []
        for location, row in iter_rows(self.files):
            messages = _messages_or_fail(row, self.prompt_key, location)
            prompt_ids = templated_prompt_ids(tokenizer, messages)
            if len(prompt_ids) > self.max_prompt_length:
                overlong.append(f"{location} ({len(prompt_ids)} tokens)")
                continue
            self.samples.append(sample_from_row(row, len(self.samples), prompt_ids, self.prompt_key))
        self.num_filtered_overlong = len(overlong)
        if overlong and not config.filter_overlong_prompts:
            raise DatasetError(
                f"{overlong[0]}: {len(overlong)} prompts exceed data.max_prompt_length="
                f"{self.max_prompt_length} tokens; raise it or set data.filter_overlong_prompts=true"
            )
        if overlong:
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (first: %s)",
                len(overlong), len(overlong) + len(self.samples), self.max_prompt_length, overlong[0],
            )
        if not self.samples:
            raise DatasetError(f"{', '.join(self.files)}: no prompts left to train on")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


def build_dataset(files: Sequence[str], tokenizer: Any, config: DataConfig) -> PromptDataset:
    """The dataset `config.dataset_class` names, or the built-in RLDataset."""
    dataset_class = RLDataset if config.dataset_class is None else load_plugin(config.dataset_class)
    return dataset_class(files, tokenizer, config)


def templated_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant turn's opening."""
    # Template to text, then encode without special tokens: the template already holds them,
    # and the text form behaves the same across transformers versions (v5 returns dicts when tokenizing).
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def iter_rows(files: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, row) for every row of the files, in order; location is file:line or file:row."""
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise DatasetError(f"{file}: no such data file")
        if path.suffix == ".parquet":
            yield from _parquet_rows(path)
        elif path.suffix == ".jsonl":
            yield from jsonl_rows(path)
        else:
            raise DatasetError(f"{file}: unsupported data file type; use .parquet or .jsonl")


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    # to_pylist keeps nested lists/structs as Python objects (pandas would give numpy arrays).
    for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"{path}:row {number}", row


def jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file:line, object) for each non-blank line; a line that is not a JSON object is a DatasetError."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            location = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{location}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{location}: expected a JSON object, got {type(row).__name__}")
            yield location, row


def _messages_or_fail(row: dict[str, Any], prompt_key: str, location: str) -> list[dict[str, str]]:
    messages = row.get(prompt_key)
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise DatasetError(
            f"{location}: '{prompt_key}' must be a non-empty list of chat messages "
            "({role, content}); set data.prompt_key if the prompt lives under another key"
        )
    return messages
