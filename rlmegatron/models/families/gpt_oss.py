"""gpt-oss (transformers' GptOssForCausalLM): GQA attention with biases on every projection and a learned sink per
head, every other layer attending within a sliding window (layer_types), YaRN rotary embedding, and every layer's MLP
a softmax-over-top-k router (with a bias) in front of experts with biases whose activation is a clamped SwiGLU:
(up + 1) * gate * sigmoid(1.702 * gate), gate clamped above and up on both sides at swiglu_limit.

In Megatron-Core: add_bias_linear (every linear biased, the router too), quick_gelu with glu_linear_offset 1 and
activation_func_clamp_value, softmax_type "learnable" (the sinks: core_attention.softmax_offset) and window_size /
window_attn_skip_freq, which this package's core attention (models.layers.SDPACoreAttention) runs; GPTModel's
"yarn" rotary embedding, whose settings are attributes of the config (config_attributes).

The checkpoint stacks each layer's experts as OpenAI releases them, [E, in, out] with gate and up interleaved along
the last dim (gate_up_proj [E, hidden, 2 x intermediate], down_proj [E, intermediate, hidden], and their biases),
which is how transformers saves them and SGLang loads them; exports and syncs stack them back
(WeightMap.hf_stream).
"""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import GLU, Family, ModelArchitecture, Source

QUICK_GELU_ALPHA = 1.702  # Megatron's quick_gelu: x * sigmoid(1.702 x)


class GptOss(Family):
    model_type = "gpt_oss"
    display_name = "gpt-oss"
    defaults = {**Family.defaults, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128,
                "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": 7.0, "attention_bias": True,
                "max_position_embeddings": 131072, "head_dim": 64}
    aliases = {"num_experts": "num_local_experts"}
    expert_count_key = "num_local_experts"
    rope_types = ("yarn",)
    position_embedding_type = "yarn"
    stacked_experts_only = True
    biased_linears = True
    attention_sinks = True

    def qkv_bias(self, cfg: Mapping[str, Any]) -> bool:
        return True  # transformers' GptOssAttention biases q/k/v and o_proj whatever attention_bias says

    def o_proj_bias(self, cfg: Mapping[str, Any]) -> bool:
        return True

    def layer_types(self, cfg: Mapping[str, Any]) -> list[str]:
        # transformers' default: sliding window on the even layers (0, 2, ...), full attention on the odd ones.
        return cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])]

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        # The base checks (SwiGLU, no o_proj bias, no sliding window) are what gpt-oss differs in, and bridges.
        problems = []
        rope = self.rope(cfg)
        if rope.kind not in self.rope_types:
            problems.append(f"rope_type={rope.kind!r} unsupported: gpt-oss is bridged with YaRN")
        if cfg["swiglu_alpha"] != QUICK_GELU_ALPHA:
            problems.append(f"swiglu_alpha={cfg['swiglu_alpha']} unsupported: Megatron's quick_gelu fixes it at "
                            f"{QUICK_GELU_ALPHA}")
        unknown = sorted(set(self.layer_types(cfg)) - {"sliding_attention", "full_attention"})
        if unknown:
            problems.append(f"layer_types {unknown} unsupported: only sliding_attention and full_attention")
        return problems

    def attention_fields(self, arch: ModelArchitecture, cfg: Mapping[str, Any]) -> dict[str, Any]:
        fields = dict(super().attention_fields(arch, cfg), softmax_type="learnable")
        if cfg.get("sliding_window"):
            # transformers' window holds sliding_window keys, the query's own included: sliding_window - 1 before it.
            fields.update(window_size=(cfg["sliding_window"] - 1, 0), window_attn_skip_freq=[
                int(kind == "sliding_attention") for kind in self.layer_types(cfg)])
        return fields

    def mlp_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        from megatron.core.activations import quick_gelu

        return dict(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                    activation_func_clamp_value=float(cfg["swiglu_limit"]), bias_activation_fusion=False)

    def config_attributes(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        params = self.rope(cfg).params
        # No mscale: the attention factor is YaRN's default, 0.1 ln(factor) + 1, as transformers computes it.
        return dict(yarn_rotary_scaling_factor=float(params["factor"]),
                    yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                    yarn_beta_fast=float(params.get("beta_fast", 32)), yarn_beta_slow=float(params.get("beta_slow", 1)),
                    yarn_mscale=None, yarn_mscale_all_dim=None,
                    yarn_correction_range_round_to_int=bool(params.get("truncate", True)))

    def attention_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        super().attention_rules(rules, m, h, arch)
        rules.add(m + "linear_proj.bias", [h + "o_proj.bias"])
        rules.add(m + "core_attention.softmax_offset", [h + "sinks"])

    def moe_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        rules.add(m + "router.weight", [h + "mlp.router.weight"])
        rules.add(m + "router.bias", [h + "mlp.router.bias"])
        stacked = h + "mlp.experts."
        for e in range(arch.num_experts):
            expert = f"{m}experts.local_experts.{e}."
            # gate = gate_up_proj[e][:, 0::2], up = gate_up_proj[e][:, 1::2], each [hidden, intermediate] (in, out).
            rules.add(expert + "linear_fc1.weight", [Source(stacked + "gate_up_proj", e, stride=(i, 2), transposed=True)
                                                     for i in (0, 1)], GLU)
            rules.add(expert + "linear_fc1.bias", [Source(stacked + "gate_up_proj_bias", e, stride=(i, 2))
                                                   for i in (0, 1)], GLU)
            rules.add(expert + "linear_fc2.weight", [Source(stacked + "down_proj", e, transposed=True)])
            rules.add(expert + "linear_fc2.bias", [Source(stacked + "down_proj_bias", e)])


FAMILY = GptOss()
