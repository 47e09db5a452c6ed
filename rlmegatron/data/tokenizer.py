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
