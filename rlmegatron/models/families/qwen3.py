"""Qwen3 (transformers' Qwen3ForCausalLM): Llama with each query and key head RMS-normalised (q_norm, k_norm)."""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import Family


class Qwen3(Family):
    model_type = "qwen3"
    display_name = "Qwen3"
    defaults = {**Family.defaults, "attention_bias": False, "use_sliding_window": False, "head_dim": 128,
                "max_position_embeddings": 32768}

    def qk_norm(self, cfg: Mapping[str, Any]) -> bool:
        return True  # no config key says so

    def sliding_window(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg["use_sliding_window"])


FAMILY = Qwen3()
