"""The HF model a run starts from, as every process that builds one reads it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSource:
    """The model every role starts from (`model.*`)."""

    path: str
    dtype: str
    """bf16, fp16 or fp32: the roles' weights and the engines' alike."""
    random_init: bool
    trust_remote_code: bool
    tokenizer_path: str
    """The run's tokenizer: the HF export holds a copy, so the exported model loads and generates as it is."""

    def hf_config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
