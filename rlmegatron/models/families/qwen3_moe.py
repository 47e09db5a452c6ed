"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (head_dim from the sizes unless set) with
Qwen2-MoE's routing and no shared expert."""
from __future__ import annotations

from rlmegatron.models.families.base import Family
from rlmegatron.models.families.qwen2_moe import QwenMoE
from rlmegatron.models.families.qwen3 import Qwen3


class Qwen3Moe(QwenMoE, Qwen3):
    model_type = "qwen3_moe"
    display_name = "Qwen3-MoE"
    defaults = {**Family.defaults, "attention_bias": False, "use_sliding_window": False,
                "max_position_embeddings": 32768, "norm_topk_prob": False, "decoder_sparse_step": 1,
                "mlp_only_layers": []}
    # transformers 5 saves the expert count as num_local_experts; Qwen's own config.json files say num_experts.
    aliases = {"num_experts": "num_local_experts"}
    expert_count_key = "num_local_experts"


FAMILY = Qwen3Moe()
