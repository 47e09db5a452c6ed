"""What a spec's `megatron` section means to Megatron-Core: the fields `extra` may set.

`extra` passes TransformerConfig fields verbatim, except those rlmegatron sets itself: from the
model's config.json, from another spec field, or because the runtime needs them (RESERVED). Fields
where rlmegatron only picks a default (dropout, the MoE dispatcher, the router's dtype, the aux-loss
coefficient, ...) are the user's to change. No torch here: megatron is imported only to list the
TransformerConfig fields, and only when `extra` holds a key that is neither reserved nor the pipeline split.
"""
from __future__ import annotations

import difflib
from typing import Any, Mapping

from rlmegatron.config.errors import SpecProblem
from rlmegatron.models.pipeline import FIRST_STAGE, LAST_STAGE

_MODEL = "comes from the model's config.json (model.path / model.hf_config)"
_RUNTIME = "is set by rlmegatron for its micro-batches and schedules"


def _from(field: str) -> str:
    return f"is set from {field}; set that instead"


# TransformerConfig field -> why `extra` may not set it; "{prefix}" is the role's megatron section.
RESERVED: dict[str, str] = {
    **{name: _MODEL for name in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
        "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
        "add_qkv_bias", "qk_layernorm", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_layer_freq", "moe_router_pre_softmax", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
        "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
        "moe_router_group_topk", "moe_router_topk_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
        "qk_pos_emb_head_dim", "v_head_dim", "rotary_base", "rope_type", "rotary_scaling_factor",
        "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "mtp_num_layers",
        # gpt-oss's sinks, sliding window and clamped SwiGLU
        "softmax_type", "window_size", "window_attn_skip_freq", "glu_linear_offset", "activation_func_clamp_value",
        "bias_activation_fusion",
        # DeepSeek-V3.2's and GLM-5's sparse attention
        "experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
        # Qwen3-Next's and Qwen3.5's gated attention, zero-centred norms and Gated DeltaNet layers
        "attention_output_gate", "layernorm_zero_centered_gamma", "linear_attention_freq", "linear_conv_kernel_dim",
        "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")},
    **{name: _from("{prefix}." + name) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
        "recompute_granularity", "recompute_method", "recompute_num_layers")},
    **{name: _from("model.dtype") for name in ("params_dtype", "pipeline_dtype", "bf16", "fp16")},
    **{name: _RUNTIME for name in (
        "variable_seq_lengths", "finalize_model_grads_func", "batch_p2p_comm", "perform_initialization")},
    # Megatron's other ways to split the pipeline; the one split function, and so conversion and the
    # planner, knows explicit first/last stage sizes only.
    **{name: f"is not supported; use {{prefix}}.extra.{FIRST_STAGE} / {LAST_STAGE} for lighter end stages"
       for name in ("pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                    "account_for_loss_in_pipeline_split")},
}


def extra_problems(prefix: str, extra: Mapping[str, Any], multi_latent_attention: bool) -> list[SpecProblem]:
    """Keys of `{prefix}.extra` that are no TransformerConfig field, or that rlmegatron sets itself."""
    problems = [SpecProblem(f"{prefix}.extra.{key}", value, RESERVED[key].format(prefix=prefix))
                for key, value in extra.items() if key in RESERVED]
    others = {key: value for key, value in extra.items() if key not in RESERVED and key not in (FIRST_STAGE, LAST_STAGE)}
    if not others:  # the pipeline split is checked by pipeline_stage_layers; nothing to look up in Megatron
        return problems
    known = transformer_config_fields(multi_latent_attention)
    for key, value in others.items():
        field = f"{prefix}.extra.{key}"
        if key not in known:
            kind = "MLATransformerConfig" if multi_latent_attention else "TransformerConfig"
            (closest,) = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.0)
            hint = f"did you mean '{closest}'?"
            if closest in RESERVED:
                hint += " That one " + RESERVED[closest].format(prefix=prefix)
            problems.append(SpecProblem(field, value, f"is not a field of Megatron-Core's {kind}; {hint}"))
    return problems


def transformer_config_fields(multi_latent_attention: bool) -> set[str]:
    """Field names of the installed Megatron-Core's (MLA)TransformerConfig."""
    import dataclasses
    import warnings

    with warnings.catch_warnings():  # Megatron warns at import about optional GPU packages
        warnings.simplefilter("ignore")
        from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    config_class = MLATransformerConfig if multi_latent_attention else TransformerConfig
    return {field.name for field in dataclasses.fields(config_class) if field.init}
