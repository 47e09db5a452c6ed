"""DeepSeek-V3.2 (transformers' DeepseekV32ForCausalLM): DeepSeek-V3 with DeepSeek Sparse Attention, a lightning
indexer in every layer's attention (self_attn.indexer: wq_b, wk, k_norm, weights_proj) choosing the index_topk keys
each query attends to (models.sparse_attention). transformers 5 builds no multi-token-prediction layer for it; the
released checkpoint's (num_nextn_predict_layers) is read as DeepSeek-V3's."""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import Family, ModelArchitecture
from rlmegatron.models.families.deepseek_v3 import DeepseekV3


class DeepseekV32(DeepseekV3):
    model_type = "deepseek_v32"
    display_name = "DeepSeek-V3.2"
    # transformers' DeepseekV32Config: DeepSeek-V3's keys but rope_interleave and num_nextn_predict_layers, which it
    # does not have (its MLA rope is always the interleaved one), and the indexer's.
    defaults = {**{k: v for k, v in DeepseekV3.defaults.items() if k not in ("rope_interleave",
                                                                           "num_nextn_predict_layers")},
                "max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
    aliases = {"num_local_experts": "n_routed_experts"}
    interleaved_rope = (True, None)
    sparse_attention = True

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg)
        if not cfg.get("q_lora_rank"):
            problems.append("q_lora_rank null unsupported: the indexer reads the low-rank query")
        if cfg["index_head_dim"] < (cfg.get("qk_rope_head_dim") or 0):
            problems.append(f"index_head_dim={cfg['index_head_dim']} unsupported: smaller than qk_rope_head_dim, "
                            "the part the indexer rotates")
        return problems

    def indexer(self, cfg: Mapping[str, Any]) -> tuple[int, int]:
        return cfg["index_n_heads"], cfg["index_head_dim"]

    def attention_fields(self, arch: ModelArchitecture, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return dict(super().attention_fields(arch, cfg), experimental_attention_variant="dsa",
                    dsa_indexer_n_heads=cfg["index_n_heads"], dsa_indexer_head_dim=cfg["index_head_dim"],
                    dsa_indexer_topk=cfg["index_topk"])

    def attention_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        super().attention_rules(rules, m, h, arch)
        indexer, ours = h + "indexer.", m + "core_attention.indexer."
        for hf_name, name in (("wq_b", "linear_wq_b"), ("wk", "linear_wk"), ("weights_proj", "linear_weights_proj")):
            rules.add(f"{ours}{name}.weight", [f"{indexer}{hf_name}.weight"])
        rules.add(ours + "k_norm.weight", [indexer + "k_norm.weight"])
        rules.add(ours + "k_norm.bias", [indexer + "k_norm.bias"])


FAMILY = DeepseekV32()
