"""A copy of the quickstart model whose config, model and tokenizer classes are the directory's own code (auto_map),
as trust_remote_code checkpoints ship them; each class notes its name in $RLM_REMOTE_CODE_MARKER when it is built."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

QUICKSTART_MODEL = Path(__file__).resolve().parents[2] / "configs" / "quickstart" / "model"

NOTE = '''
import os


def note(obj):
    marker = os.environ.get("RLM_REMOTE_CODE_MARKER")
    if marker:
        with open(marker, "a") as handle:
            handle.write(type(obj).__name__ + "\\n")
'''
FILES = {
    "configuration_echo.py": NOTE + '''
from transformers import Qwen3Config


class EchoConfig(Qwen3Config):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        note(self)
''',
    "modeling_echo.py": NOTE + '''
from transformers import Qwen3ForCausalLM

from .configuration_echo import EchoConfig


class EchoForCausalLM(Qwen3ForCausalLM):
    config_class = EchoConfig

    def __init__(self, config):
        super().__init__(config)
        note(self)
''',
    # A slow tokenizer with its own vocabulary file and no tokenizer.json, so no built-in class can stand in for it.
    "tokenization_echo.py": NOTE + '''
import json

from transformers import PreTrainedTokenizer


class EchoTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "echo_vocab.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        with open(vocab_file) as handle:
            self.vocab = json.load(handle)
        self.tokens = {index: token for token, index in self.vocab.items()}
        super().__init__(**kwargs)
        note(self)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, self.vocab["<unk>"])

    def _convert_id_to_token(self, index):
        return self.tokens.get(index, "<unk>")

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)
''',
}


def write_remote_code_model(directory: Path) -> Path:
    """`directory` holding the quickstart model (config, tokenizer) served by its own code; returns it."""
    shutil.copytree(QUICKSTART_MODEL, directory)
    for name, text in FILES.items():
        (directory / name).write_text(text)
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_echo.EchoConfig",
                          "AutoModelForCausalLM": "modeling_echo.EchoForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer_json = directory / "tokenizer.json"
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]  # the quickstart's character vocabulary
    tokenizer_json.unlink()
    (directory / "echo_vocab.json").write_text(json.dumps(vocab))
    tokenizer = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer.update(tokenizer_class="EchoTokenizer", auto_map={"AutoTokenizer": ["tokenization_echo.EchoTokenizer", None]})
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))
    return directory
