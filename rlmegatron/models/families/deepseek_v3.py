"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM): multi-latent attention (MLA) with yarn rope, and DeepSeek's
MoE, which GLM-4.5 shares (DeepSeekMoE)."""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import Family, ModelArchitecture, MultiLatentAttention, SameBucket, whole_number


def unsupported(cfg: Mapping[str, Any], field: str, allowed: tuple, why: str) -> list[str]:
    value = cfg.get(field)
    return [] if value in allowed else [f"{field}={value!r} unsupported: {why}"]


class DeepSeekMoE:
    """The MoE of DeepSeek-V3 and GLM-4.5 in transformers (a mixin before the attention's family): routed experts on
    every layer from first_k_dense_replace on, a sigmoid router whose choice adds an expert bias
    (e_score_correction_bias) and is limited to the topk_group best of n_group expert groups, top-k weights
    renormalised and scaled by routed_scaling_factor, n_shared_experts shared experts without a gate, and
    num_nextn_predict_layers multi-token-prediction layers after the decoder layers, each holding copies of the
    embedding and the output head (which transformers neither builds nor saves)."""

    aliases = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
    expert_count_key = "n_routed_experts"

    def moe_layers(self, cfg: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
        return tuple(i >= cfg["first_k_dense_replace"] for i in range(num_layers))

    def shared_experts(self, cfg: Mapping[str, Any], expert_ffn_size: int) -> tuple[int, bool]:
        return (cfg["n_shared_experts"] or 0) * expert_ffn_size, False

    def router_bias(self, cfg: Mapping[str, Any]) -> bool:
        return True

    def num_mtp_layers(self, cfg: Mapping[str, Any]) -> int:
        return whole_number(cfg, "num_nextn_predict_layers") or 0

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg) + unsupported(
            cfg, "norm_topk_prob", (True,), "Megatron always renormalises sigmoid top-k scores")
        groups, chosen, top_k = cfg["n_group"], cfg["topk_group"], cfg.get("num_experts_per_tok")
        if groups and groups > 1 and chosen and top_k and top_k // chosen != 2:
            problems.append(f"num_experts_per_tok={top_k} with topk_group={chosen} unsupported: transformers ranks the "
                            "n_group expert groups by their 2 best scores, Megatron by their num_experts_per_tok / "
                            "topk_group best, and those differ")
        return problems

    def router_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_num_groups=cfg["n_group"], moe_router_group_topk=cfg["topk_group"],
                    moe_router_topk_scaling_factor=cfg["routed_scaling_factor"])


class DeepseekV3(DeepSeekMoE, Family):
    model_type = "deepseek_v3"
    display_name = "DeepSeek-V3"
    defaults = {**Family.defaults, "attention_bias": False, "max_position_embeddings": 4096, "norm_topk_prob": True,
                "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "n_shared_experts": 1,
                "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "rope_interleave": True,
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128}
    # MLA's rotary embedding is DeepSeek's own (yarn); the GQA families use GPTModel's (llama3 scaling).
    rope_types = ("default", "yarn")
    multi_latent_attention = True
    interleaved_rope = (True,)  # the values of rope_interleave that mean Megatron's (interleaved) MLA rope

    def mla(self, cfg: Mapping[str, Any]) -> MultiLatentAttention:
        return MultiLatentAttention(q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"],
                                    qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                                    v_head_dim=cfg["v_head_dim"])

    def o_proj_bias(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        return (super().problems(cfg)
                + unsupported(cfg, "attention_bias", (None, False), "transformers then gives the MLA down projections "
                              "(q_a_proj, kv_a_proj_with_mqa) biases, which Megatron's MLA does not have")
                + unsupported(cfg, "scoring_func", (None, "sigmoid"), "Megatron's DeepSeek router here is sigmoid")
                + unsupported(cfg, "topk_method", (None, "noaux_tc"), "only the aux-loss-free (expert bias) router is "
                              "bridged")
                + unsupported(cfg, "moe_layer_freq", (None, 1), "transformers makes every layer from "
                              "first_k_dense_replace on MoE, DeepSeek's own code only every moe_layer_freq-th")
                + unsupported(cfg, "rope_interleave", self.interleaved_rope, "Megatron's MLA rope is the interleaved "
                              "one"))

    def attention_fields(self, arch: ModelArchitecture, cfg: Mapping[str, Any]) -> dict[str, Any]:
        rope = self.rope(cfg)
        yarn = rope.kind == "yarn"
        params = rope.params
        mla = arch.mla
        return dict(
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_head_dim=mla.qk_nope_head_dim,
            qk_pos_emb_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            qk_layernorm=True,
            rotary_base=rope.theta,
            rope_type="yarn" if yarn else "rope",
            rotary_scaling_factor=float(params.get("factor", 1.0)) if yarn else 1.0,
            original_max_position_embeddings=params.get("original_max_position_embeddings",
                                                        arch.max_position_embeddings or 4096),
            beta_fast=float(params.get("beta_fast", 32)),
            beta_slow=float(params.get("beta_slow", 1)),
            mscale=float(params.get("mscale", 1.0)) if yarn else 1.0,
            mscale_all_dim=float(params.get("mscale_all_dim", 0.0)) if yarn else 0.0,
        )

    def attention_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        if arch.mla.q_lora_rank:
            rules.add(m + "linear_q_down_proj.weight", [h + "q_a_proj.weight"])
            rules.add(m + "q_layernorm.weight", [h + "q_a_layernorm.weight"])
            rules.add(m + "linear_q_up_proj.weight", [h + "q_b_proj.weight"])
        else:
            rules.add(m + "linear_q_proj.weight", [h + "q_proj.weight"])
        rules.add(m + "linear_kv_down_proj.weight", [h + "kv_a_proj_with_mqa.weight"])
        rules.add(m + "kv_layernorm.weight", [h + "kv_a_layernorm.weight"])
        rules.add(m + "linear_kv_up_proj.weight", [h + "kv_b_proj.weight"])

    def same_bucket(self, cfg: Mapping[str, Any]) -> tuple[SameBucket, ...]:
        # SGLang fuses these two into fused_qkv_a_proj_with_mqa while loading, so it needs both in one call; the
        # suffix (weight, weight_scale_inv) stays in the key because each pair is fused separately. Without a
        # low-rank query (q_lora_rank null, as DeepSeek-V2-Lite) there is no q_a_proj to wait for.
        if not cfg["q_lora_rank"]:
            return ()
        return (SameBucket(r"^.*\.self_attn\.(?P<member>q_a_proj|kv_a_proj_with_mqa)\..+$",
                           frozenset({"q_a_proj", "kv_a_proj_with_mqa"})),)


FAMILY = DeepseekV3()
