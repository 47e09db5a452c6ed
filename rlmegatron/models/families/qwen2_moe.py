"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention with its own q/k/v-bias switch, softmax-routed experts
on every decoder_sparse_step-th layer not in mlp_only_layers, and one shared expert scaled by a learned gate."""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import ModelArchitecture, whole_number
from rlmegatron.models.families.qwen2 import Qwen2


class QwenMoE:
    """The routing Qwen2-MoE and Qwen3-MoE share (a mixin before their attention's family)."""

    def moe_layers(self, cfg: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
        dense = set(cfg["mlp_only_layers"] or [])
        return tuple(i not in dense and (i + 1) % cfg["decoder_sparse_step"] == 0 for i in range(num_layers))

    def router_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        # norm_topk_prob: softmax over the top-k (Megatron's default); else softmax over all, then top-k.
        return {"moe_router_pre_softmax": not cfg["norm_topk_prob"]}


class Qwen2Moe(QwenMoE, Qwen2):
    model_type = "qwen2_moe"
    display_name = "Qwen2-MoE"
    defaults = {**Qwen2.defaults, "qkv_bias": True, "norm_topk_prob": False, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "shared_expert_intermediate_size": 5632}
    expert_count_key = "num_experts"
    shared_experts_module = "mlp.shared_expert"

    def qkv_bias(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg["qkv_bias"])

    def shared_experts(self, cfg: Mapping[str, Any], expert_ffn_size: int) -> tuple[int, bool]:
        size = whole_number(cfg, "shared_expert_intermediate_size") or 0
        return size, bool(size)

    def moe_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        super().moe_rules(rules, m, h, arch)
        if arch.shared_expert_gate:
            rules.add(m + "shared_experts.gate_weight", [h + "mlp.shared_expert_gate.weight"])


FAMILY = Qwen2Moe()
