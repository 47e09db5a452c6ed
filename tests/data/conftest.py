"""Shared fixtures of the data tests: one hub-free tokenizer per session."""
import pytest

from rlmegatron.data.tokenizer import build_char_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()
