"""Llama (transformers' LlamaForCausalLM): the base family, with Llama-3's rope scaling and Llama's bias switches."""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import Family


class Llama(Family):
    model_type = "llama"
    display_name = "Llama"
    defaults = {**Family.defaults, "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 2048}

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg)
        if cfg["mlp_bias"]:
            problems.append(f"mlp_bias={cfg['mlp_bias']!r} unsupported: Megatron's MLP here has no bias")
        return problems


FAMILY = Llama()
