"""Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM): Llama with q/k/v biases that no config key announces."""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import Family


class Qwen2(Family):
    model_type = "qwen2"
    display_name = "Qwen2"
    defaults = {**Family.defaults, "use_sliding_window": False, "max_position_embeddings": 32768}

    def qkv_bias(self, cfg: Mapping[str, Any]) -> bool:
        return True  # transformers' Qwen2Attention always builds them, whatever attention_bias says

    def o_proj_bias(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def sliding_window(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg["use_sliding_window"])


FAMILY = Qwen2()
