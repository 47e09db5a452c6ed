"""GLM-5 (transformers' GlmMoeDsaForCausalLM): DeepSeek-V3.2's sparse attention (models.families.deepseek_v32) with
GLM's sizes, an indexer whose rotary embedding rotates interleaved pairs, and per layer `indexer_types`: "full"
layers run their own indexer; "shared" layers reuse the previous full layer's selection, which is not bridged
(refused by name)."""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.deepseek_v32 import DeepseekV32


class GlmMoeDsa(DeepseekV32):
    model_type = "glm_moe_dsa"
    display_name = "GLM-5"
    defaults = {**DeepseekV32.defaults, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "n_group": 1,
                "topk_group": 1, "first_k_dense_replace": 3, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
                "v_head_dim": 256, "index_n_heads": 32}

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg)
        shared = [i for i, kind in enumerate(cfg.get("indexer_types") or []) if kind != "full"]
        if shared:
            problems.append(f"indexer_types: layers {shared[:8]} reuse an earlier layer's top-k keys (\"shared\"), "
                            "which is not bridged; only configs whose every layer runs its indexer (\"full\")")
        return problems

    def config_attributes(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().config_attributes(cfg), "dsa_indexer_rope_interleaved": True}


FAMILY = GlmMoeDsa()
