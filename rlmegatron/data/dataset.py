"""The built-in prompt dataset: verl-format rows from parquet or jsonl, chat-templated and length-filtered."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlmegatron.data.records import Sample, sample_from_row
from rlmegatron.errors import UserError
from rlmegatron.plugins import load_plugin

if TYPE_CHECKING:
    from rlmegatron.config.spec import DataConfig

logger = logging.getLogger(__name__)


class DatasetError(UserError, ValueError):
    """Data that cannot be used; for a row, the message starts with file:line (jsonl) or file:row N (parquet)."""


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
        encode = PromptEncoder(tokenizer)
        for location, row in iter_rows(self.files):
            prompt_ids = encode(prompt_messages(row, self.prompt_key, location), location)
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


class PromptEncoder:
    """Token ids of a chat-templated prompt, ending with the assistant turn's opening.

    Template to text, then encode without special tokens: the template already holds the ones it wants, and
    the text form behaves the same across transformers versions (v5 returns dicts when tokenizing). A tokenizer
    that puts a BOS before every text by itself gets exactly one: its own, or the one its template wrote.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bos_id = _bos_added_by(tokenizer)

    def __call__(self, messages: list[dict[str, str]], location: str = "") -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # a Jinja template raises whatever its author chose (raise_exception, TypeError)
            where = f"{location}: " if location else ""
            raise DatasetError(
                f"{where}the tokenizer's chat template fails on this prompt ({type(err).__name__}: {_one_line(err)}); "
                "fix the messages, or use a tokenizer whose template accepts them"
            ) from err
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids


def _bos_added_by(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer prepends to a text when asked for special tokens; None if it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if special[:1] == [bos] and plain[:1] != [bos] else None


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
    import pyarrow as pa
    import pyarrow.parquet as pq

    number = 0
    try:
        # Batch by batch, so reading the first rows (the pre-launch check) does not read the whole file.
        # to_pylist keeps nested lists/structs as Python objects (pandas would give numpy arrays).
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield f"{path}:row {number}", row
    except (pa.ArrowException, OSError) as err:
        where = f"after row {number}" if number else "at its start"
        raise DatasetError(
            f"{path}: not a readable parquet file ({where}: {_one_line(err)}); write it again (rlm prepare) or "
            "replace it"
        ) from None


def jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file:line, object) for each non-blank line; a line that is not a JSON object is a DatasetError."""
    number = 0
    with path.open(encoding="utf-8") as lines:
        try:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                location = f"{path}:{number}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{location}: not valid JSON ({err.msg}); fix or remove that line") from None
                if not isinstance(row, dict):
                    raise DatasetError(f"{location}: expected a JSON object, got {type(row).__name__}")
                yield location, row
        except UnicodeDecodeError:
            raise DatasetError(f"{path}:{number + 1}: not UTF-8 text; a .jsonl file holds one JSON object per line") \
                from None


def prompt_messages(row: dict[str, Any], prompt_key: str, location: str) -> list[dict[str, str]]:
    """The row's chat messages under `prompt_key`; a DatasetError naming the row and the fix when there are none."""
    if prompt_key not in row:
        raise DatasetError(
            f"{location}: no '{prompt_key}' key (it has {', '.join(map(repr, row)) or 'none'}); set data.prompt_key "
            "to the one holding the chat messages"
        )
    messages = row[prompt_key]
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise DatasetError(
            f"{location}: '{prompt_key}' must be a non-empty list of chat messages "
            "({role, content}); set data.prompt_key if the prompt lives under another key"
        )
    return messages


def _one_line(err: BaseException) -> str:
    """A library's message for a line of ours: pyarrow's and Jinja's can span several."""
    return " ".join(str(err).split())
