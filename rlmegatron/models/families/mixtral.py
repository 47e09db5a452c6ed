"""Mixtral (transformers' MixtralForCausalLM): Llama's attention without any bias, and every layer's MLP a
softmax-routed set of experts under block_sparse_moe (w1/w3/w2)."""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import Family


class Mixtral(Family):
    model_type = "mixtral"
    display_name = "Mixtral"
    defaults = {**Family.defaults, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072}
    aliases = {"num_experts": "num_local_experts"}
    expert_count_key = "num_local_experts"
    moe_block = "block_sparse_moe"
    expert_projections = ("w1", "w3", "w2")

    def qkv_bias(self, cfg: Mapping[str, Any]) -> bool:
        return False  # transformers' MixtralAttention has none, whatever attention_bias says

    def o_proj_bias(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def sliding_window(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg.get("sliding_window"))


FAMILY = Mixtral()
