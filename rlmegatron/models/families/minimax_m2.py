"""MiniMax-M2 (transformers' MiniMaxM2ForCausalLM): GQA attention whose query and key norms each take all heads of a
token as one vector (models.all_heads_norm), rotary embedding on the first rotary_dim dimensions of each head, and
every layer's MLP a set of experts under block_sparse_moe (w1/w3/w2, sized by intermediate_size) behind a sigmoid
router whose choice adds an expert bias (block_sparse_moe.e_score_correction_bias) and whose top-k weights are
renormalised, as DeepSeek-V3's without expert groups."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlmegatron.models.families.base import Family, ModelArchitecture, Rope


class MiniMaxM2(Family):
    model_type = "minimax_m2"
    display_name = "MiniMax-M2"
    defaults = {**Family.defaults, "rope_theta": 5e6, "max_position_embeddings": 196608}
    aliases = {"num_experts": "num_local_experts"}
    expert_count_key = "num_local_experts"
    moe_block = "block_sparse_moe"
    expert_projections = ("w1", "w3", "w2")
    qk_norm_over_all_heads = True

    def qkv_bias(self, cfg: Mapping[str, Any]) -> bool:
        return False  # transformers' MiniMaxM2Attention has none

    def o_proj_bias(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def qk_norm(self, cfg: Mapping[str, Any]) -> bool:
        return True  # built whatever use_qk_norm says, as transformers does

    def router_bias(self, cfg: Mapping[str, Any]) -> bool:
        return True

    def rope(self, cfg: Mapping[str, Any]) -> Rope:
        # The released config.json says rotary_dim (64 of head_dim 128); transformers 5 turns it into
        # rope_parameters.partial_rotary_factor.
        rope = super().rope(cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        factor = rope.params.get("partial_rotary_factor") or (cfg.get("rotary_dim") or head_dim) / head_dim
        return dataclasses.replace(rope, percent=float(factor))

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg)
        if cfg.get("scoring_func") not in (None, "sigmoid"):
            problems.append(f"scoring_func={cfg['scoring_func']!r} unsupported: transformers' MiniMax-M2 router is "
                            "sigmoid")
        return problems

    def router_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)

    def moe_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        block = f"{h}{self.moe_block}."
        rules.add(m + "router.weight", [block + "gate.weight"])
        rules.add(m + "router.expert_bias", [block + "e_score_correction_bias"])
        rules.experts(m + "experts.", block + "experts.", self.expert_projections)


FAMILY = MiniMaxM2()
