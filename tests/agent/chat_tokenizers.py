"""A byte-level BPE tokenizer with ChatML specials, trained on a few tool-calling turns, so a response the policy
samples token by token is not how the tokenizer would cut its text (re-tokenizing it gives other ids)."""
from __future__ import annotations

import functools

from rlmegatron.data.tokenizer import CHAT_TEMPLATE

CORPUS = [
    '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"x": 3, "y": 4}}</tool_call>',
    "The answer is 7. The lookup of the key gives the value.",
] * 20


@functools.cache
def bpe_chat_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)


def byte_tokens(tokenizer, text: str) -> list[int]:
    """`text` as one token per byte-level character: a tokenization the policy may sample, not the tokenizer's own."""
    ids = []
    for char in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text):
        ids += [tokenizer.convert_tokens_to_ids(c) for c in char[0]]
    return ids
