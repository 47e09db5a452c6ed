"""The built-in prompt dataset: rows from parquet or jsonl (verl's chat rows, or plain prompt/answer rows),
tokenized and length-filtered."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlmegatron.data.images import IMAGE_MARK, ImageError, ImagePrompts
from rlmegatron.data.records import Sample, sample_from_row
from rlmegatron.errors import UserError
from rlmegatron.models.families import ArchitectureError, read_architecture
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
    """Prompts of one or more data files, read as data.prompt_format and data.answer_key say; a custom
    `data.dataset_class` takes the same arguments."""

    def __init__(self, files: Sequence[str], tokenizer: Any, config: DataConfig,
                 processor_path: str | None = None) -> None:
        """`processor_path`: a vision-language model's directory (its image processor), which rows with images
        need."""
        self.files = list(files)
        self.max_prompt_length = config.max_prompt_length
        self.samples: list[Sample] = []
        overlong: list[str] = []
        read = RowReader(config)
        encode = PromptEncoder(tokenizer, chat=config.prompt_format == "chat")
        image_prompts = None
        for file in self.files:
            for location, row in iter_rows([file]):
                prompt, images = read.prompt(row, location), None
                if row.get(config.image_key) or IMAGE_MARK in str(prompt):
                    if image_prompts is None:
                        image_prompts = _image_prompts(processor_path, tokenizer, config, location)
                    shown, _ = image_prompts.mark_images(prompt, row, location)
                    images = image_prompts.read(row, Path(file).parent, location)
                    prompt_ids = image_prompts.expand(encode(shown, location), images, location)
                else:
                    prompt_ids = encode(prompt, location)
                if len(prompt_ids) > self.max_prompt_length:
                    overlong.append(f"{location} ({len(prompt_ids)} tokens)")
                    continue
                self.samples.append(sample_from_row(row, len(self.samples), prompt, prompt_ids,
                                                    read.answer(row, location), images))
        self.image_prompts = image_prompts
        """The image processor, when a row has images: the driver makes the actor's pixel values with it."""
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


def build_dataset(files: Sequence[str], tokenizer: Any, config: DataConfig,
                  processor_path: str | None = None) -> PromptDataset:
    """The dataset `config.dataset_class` names, or the built-in RLDataset (which reads rows with images through
    the image processor in `processor_path`, a vision-language model's directory)."""
    if config.dataset_class is not None:
        return load_plugin(config.dataset_class)(files, tokenizer, config)
    return RLDataset(files, tokenizer, config, processor_path)


def _image_prompts(processor_path: str | None, tokenizer: Any, config: DataConfig, location: str) -> ImagePrompts:
    if processor_path is None or not Path(processor_path, "preprocessor_config.json").is_file():
        raise ImageError(f"{location}: the row has images ('{config.image_key}' or an {IMAGE_MARK} mark) but the "
                         "model has no image processor (preprocessor_config.json); train a vision-language model "
                         "such as Qwen2.5-VL, or drop the images")
    try:
        architecture = read_architecture(processor_path)
    except ArchitectureError:  # a tokenizer directory beside the model (model.tokenizer_path): no config to read
        architecture = None
    if architecture is not None and architecture.vision is None:
        # Qwen3.5-MoE's and Kimi-K2.5's checkpoints ship an image processor, but their towers are carried as they
        # are (models.carried), never run: the images would reach a text-only model.
        raise ImageError(f"{location}: the row has images ('{config.image_key}' or an {IMAGE_MARK} mark) but the "
                         f"model's image encoder ({architecture.model_type}) is not bridged: it trains on text; drop "
                         "the images")
    return ImagePrompts(processor_path, tokenizer, config.image_key, config.max_image_pixels)


class PromptEncoder:
    """Token ids of a prompt: chat messages templated and ending with the assistant turn's opening (`chat`), or a
    plain text as it is.

    Template to text, then encode without special tokens: the template already holds the ones it wants, the text
    form behaves the same across transformers versions (v5 returns dicts when tokenizing), and a tokenizer that
    also appends an EOS to every text must not end a prompt with it. A tokenizer that puts a BOS before every text
    by itself gets exactly one: its own, or the one its template wrote.
    """

    def __init__(self, tokenizer: Any, chat: bool = True) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.bos_id = _bos_added_by(tokenizer)

    def __call__(self, prompt: list[dict[str, str]] | str, location: str = "") -> list[int]:
        text = self._template(prompt, location) if self.chat else prompt
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def _template(self, messages: list[dict[str, str]], location: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # a Jinja template raises whatever its author chose (raise_exception, TypeError)
            where = f"{location}: " if location else ""
            raise DatasetError(
                f"{where}the tokenizer's chat template fails on this prompt ({type(err).__name__}: {_one_line(err)}); "
                "fix the messages, or use a tokenizer whose template accepts them"
            ) from err


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


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object a line, as jsonl_rows reads them back (the shipped tasks' make_assets.py scripts)."""
    with path.open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)


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


class RowReader:
    """A row's prompt (data.prompt_key, as data.prompt_format says) and ground truth (data.answer_key); a
    DatasetError naming the row and the fix when either is not there."""

    def __init__(self, config: DataConfig) -> None:
        self.prompt_key, self.chat = config.prompt_key, config.prompt_format == "chat"
        self.answer_key = config.answer_key

    def prompt(self, row: dict[str, Any], location: str) -> list[dict[str, str]] | str:
        key = self.prompt_key
        if key not in row:
            what = "chat messages" if self.chat else "prompt text"
            raise DatasetError(
                f"{location}: no '{key}' key (it has {', '.join(map(repr, row)) or 'none'}); set data.prompt_key "
                f"to the one holding the {what}"
            )
        prompt = row[key]
        if not self.chat:
            if not isinstance(prompt, str) or not prompt:
                raise DatasetError(
                    f"{location}: '{key}' must be a non-empty text with data.prompt_format=plain, got "
                    f"{type(prompt).__name__}; chat messages need data.prompt_format=chat"
                )
            return prompt
        if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt
        ):
            plain = "; a plain text prompt needs data.prompt_format=plain" if isinstance(prompt, str) else ""
            raise DatasetError(
                f"{location}: '{key}' must be a non-empty list of chat messages "
                f"({{role, content}}); set data.prompt_key if the prompt lives under another key{plain}"
            )
        return prompt

    def answer(self, row: dict[str, Any], location: str) -> Any:
        node: Any = row
        for depth, part in enumerate(self.answer_key.split(".")):
            if not isinstance(node, dict) or part not in node:
                where = ".".join(self.answer_key.split(".")[:depth]) or "the row"
                found = (f"{where} has {', '.join(map(repr, node)) or 'no keys'}" if isinstance(node, dict)
                         else f"{where} is {type(node).__name__}")
                raise DatasetError(
                    f"{location}: no ground truth at data.answer_key={self.answer_key} ({found}); set "
                    "data.answer_key to the dotted key that holds it"
                )
            node = node[part]
        return node


def _one_line(err: BaseException) -> str:
    """A library's message for a line of ours: pyarrow's and Jinja's can span several."""
    return " ".join(str(err).split())
