"""GLM-4.5 / GLM-4.5-Air (transformers' Glm4MoeForCausalLM): DeepSeek-V3's MoE and multi-token-prediction layers
behind GQA attention with q/k/v biases (attention_bias; o_proj has none), optional query/key norms (use_qk_norm) and
rotary embedding on the first partial_rotary_factor of each head (GPTModel's rotary_percent)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlmegatron.models.families.base import Family, Rope
from rlmegatron.models.families.deepseek_v3 import DeepSeekMoE


class Glm4Moe(DeepSeekMoE, Family):
    model_type = "glm4_moe"
    display_name = "GLM-4.5"
    defaults = {**Family.defaults, "rms_norm_eps": 1e-5, "attention_bias": False, "max_position_embeddings": 131072,
                "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 1,
                "use_qk_norm": False, "partial_rotary_factor": 0.5}
    aliases = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
    rope_types = ("default",)

    def o_proj_bias(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def qk_norm(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg["use_qk_norm"])

    def rope(self, cfg: Mapping[str, Any]) -> Rope:
        # GLM's own config.json has partial_rotary_factor at its top level; transformers 5 moves it to rope_parameters.
        rope = super().rope(cfg)
        return dataclasses.replace(rope, percent=float(rope.params.get("partial_rotary_factor",
                                                                       cfg["partial_rotary_factor"])))


FAMILY = Glm4Moe()
