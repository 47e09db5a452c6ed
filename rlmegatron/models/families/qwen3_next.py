"""Qwen3-Next (transformers' Qwen3NextForCausalLM), and the hybrid decoder Qwen3.5-MoE shares with it (qwen3_5_moe.py
differs only in where the checkpoint keeps its tensors and how it names Gated DeltaNet's projections).

Layers alternate, as layer_types says (three in four by default), between Gated DeltaNet linear attention
(models.gated_delta_net) and gated full attention: GQA whose q_proj yields each head's query and then its output
gate, sigmoid(gate) scaling the attention output before o_proj (Megatron's attention_output_gate), with per-head
query/key norms and rotary embedding on a quarter of each head. Every RMSNorm of the decoder, those query/key norms
included, scales by (1 + weight) with the weight stored zero-centred (models.layers.ZeroCenteredRMSNorm); Gated
DeltaNet's own output norm scales by its weight. The MLPs are Qwen2-MoE's: softmax-routed experts and one shared
expert behind a sigmoid gate, in every layer (dense layers, which transformers' Qwen3-Next can build, are refused:
SGLang builds none).

The released checkpoints also hold a multi-token-prediction layer under mtp.*, which transformers neither builds nor
loads and Megatron-Core's MTP cannot express as it is (its own norms and fc over the embedding and hidden state):
it is carried through conversion and every export unchanged (models.carried), never trained or synced, so SGLang's
speculative decoding reads the released MTP weights.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlmegatron.models.families.base import CONCAT, QKV, Family, LinearAttention, ModelArchitecture, Rope, Rows, Source
from rlmegatron.models.families.qwen2_moe import Qwen2Moe

LINEAR, FULL = "linear_attention", "full_attention"
# transformers' default when config.json has no layer_types: every 4th layer full attention (its config class reads
# full_attention_interval once and keeps only layer_types, so it is no default of the class's).
FULL_ATTENTION_INTERVAL = 4


class Qwen3Next(Qwen2Moe):
    model_type = "qwen3_next"
    display_name = "Qwen3-Next"
    defaults = {**Family.defaults, "attention_bias": False, "head_dim": 256, "max_position_embeddings": 32768,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "shared_expert_intermediate_size": 512, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32}
    carried_prefixes = ("mtp.",)
    attention_output_gate = True
    zero_centered_norms = True

    def qkv_bias(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg["attention_bias"])

    def o_proj_bias(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg["attention_bias"])

    def qk_norm(self, cfg: Mapping[str, Any]) -> bool:
        return True

    def sliding_window(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def rope(self, cfg: Mapping[str, Any]) -> Rope:
        rope = super().rope(cfg)
        return dataclasses.replace(rope, percent=float(rope.params.get("partial_rotary_factor",
                                                                       cfg["partial_rotary_factor"])))

    def layer_types(self, cfg: Mapping[str, Any]) -> list[str]:
        interval = cfg.get("full_attention_interval") or FULL_ATTENTION_INTERVAL
        return cfg.get("layer_types") or [LINEAR if (i + 1) % interval else FULL
                                           for i in range(cfg["num_hidden_layers"])]

    def linear_attention(self, cfg: Mapping[str, Any], num_layers: int) -> LinearAttention | None:
        return LinearAttention(cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                               cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"],
                               tuple(kind == LINEAR for kind in self.layer_types(cfg)))

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg)
        unknown = sorted(set(self.layer_types(cfg)) - {LINEAR, FULL})
        if unknown:
            problems.append(f"layer_types {unknown} unsupported: only {LINEAR} and {FULL}")
        dense, step = cfg.get("mlp_only_layers") or [], cfg.get("decoder_sparse_step", 1)
        if "mlp_only_layers" in self.defaults and (dense or step != 1):  # keys Qwen3.5's transformers code ignores
            # transformers' Qwen3-Next builds such dense layers; SGLang 0.5.23 builds every layer of these models
            # routed, and no released checkpoint has one.
            problems.append(f"mlp_only_layers={dense} / decoder_sparse_step={step} unsupported: SGLang builds every "
                            f"{self.display_name} layer with routed experts")
        if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
            problems.append(f"linear_num_value_heads={cfg['linear_num_value_heads']} is not a multiple of "
                            f"linear_num_key_heads={cfg['linear_num_key_heads']}")
        return problems

    def moe_layers(self, cfg: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
        return (True,) * num_layers  # dense layers are refused (problems)

    def attention_fields(self, arch: ModelArchitecture, cfg: Mapping[str, Any]) -> dict[str, Any]:
        linear = arch.linear_attention
        return dict(super().attention_fields(arch, cfg), attention_output_gate=True,
                    layernorm_zero_centered_gamma=True, experimental_attention_variant="gated_delta_net",
                    linear_attention_freq=[int(layer) for layer in linear.layers],
                    linear_conv_kernel_dim=linear.conv_kernel, linear_key_head_dim=linear.key_head_dim,
                    linear_value_head_dim=linear.value_head_dim, linear_num_key_heads=linear.num_key_heads,
                    linear_num_value_heads=linear.num_value_heads)

    # ---- weight map ------------------------------------------------------------------------------------------
    def mixer_rules(self, rules, m: str, h: str, arch: ModelArchitecture, layer: int) -> None:
        if not arch.linear_attention.layers[layer]:
            return super().mixer_rules(rules, m, h, arch, layer)
        linear, m, h = arch.linear_attention, m + "self_attention.", h + "linear_attn."
        keys, values = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim
        # Megatron's in_proj rows, each part split over TP by heads: q, k, v, z (the output gate), b (the write
        # strength), a (the decay's step); its conv1d's: q, k, v.
        rules.add(m + "in_proj.weight", self.projection_sources(h, linear), CONCAT)
        rules.add(m + "conv1d.weight", [Source(h + "conv1d.weight", rows=Rows(1, 2 * keys + values, start, rows))
                                        for start, rows in ((0, keys), (keys, keys), (2 * keys, values))], CONCAT)
        for name in ("dt_bias", "A_log"):
            rules.add(m + name, [h + name])
        rules.add(m + "out_norm.weight", [h + "norm.weight"])
        rules.add(m + "out_proj.weight", [h + "out_proj.weight"])

    def projection_sources(self, h: str, linear: LinearAttention) -> list[Source]:
        """q, k, v, z, b, a of Gated DeltaNet's input projections: Qwen3-Next fuses them per key head, in_proj_qkvz
        holding each key head's q, k and its value heads' v and z rows together, in_proj_ba its value heads' b and a."""
        per_key = linear.num_value_heads // linear.num_key_heads
        dk, dv = linear.key_head_dim, per_key * linear.value_head_dim
        groups = linear.num_key_heads
        return [Source(h + "in_proj_qkvz.weight", rows=Rows(groups, 2 * dk + 2 * dv, start, rows))
                for start, rows in ((0, dk), (dk, dk), (2 * dk, dv), (2 * dk + dv, dv))] + \
               [Source(h + "in_proj_ba.weight", rows=Rows(groups, 2 * per_key, start, per_key))
                for start in (0, per_key)]

    def attention_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        # q_proj holds each head's query rows, then its gate rows: Megatron's linear_qkv per query group [q; gate;
        # k; v].
        heads, d = arch.num_attention_heads, arch.head_dim
        q_and_gate = [Source(h + "q_proj.weight", rows=Rows(heads, 2 * d, start, d)) for start in (0, d)]
        rules.add(m + "linear_qkv.weight", q_and_gate + [Source(h + f"{p}_proj.weight") for p in "kv"], QKV)
        rules.add(m + "q_layernorm.weight", [h + "q_norm.weight"])
        rules.add(m + "k_layernorm.weight", [h + "k_norm.weight"])


FAMILY = Qwen3Next()
