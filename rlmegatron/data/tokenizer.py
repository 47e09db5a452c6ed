"""A hub-free character-level tokenizer with a chat template, for the quickstart and tests."""
from __future__ import annotations

import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen uses, so prompts look like the ones the real models see.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer(out_dir: str | Path | None = None) -> Any:
    """A PreTrainedTokenizerFast with one token per printable ASCII character plus the ChatML
    specials; saved to `out_dir` (loadable with AutoTokenizer.from_pretrained) when given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *dict.fromkeys(string.printable)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own word; special tokens are matched whole before this split runs.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # Qwen2.5-VL's, around each image


def save_tiny_vision_processor(out_dir: str | Path) -> Any:
    """A hub-free tokenizer and image processor of a tiny Qwen2.5-VL in `out_dir` (the vision quickstart's, and the
    tests'): the char tokenizer with Qwen2.5-VL's vision tokens and a bare chat template (the prompt's text alone),
    and Qwen2-VL's image processor at 4-pixel patches, so an 8x8-pixel image is 2x2 patches, one merged token.
    Returns the tokenizer."""
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    tokenizer.save_pretrained(str(out_dir))
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                             size={"shortest_edge": 64, "longest_edge": 64 * 64}).save_pretrained(str(out_dir))
    return tokenizer
