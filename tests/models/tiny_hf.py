"""Tiny random-weight HF checkpoints of every bridged family, saved with transformers' own save_pretrained."""
from __future__ import annotations

import torch

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=200,
              max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILY_CONFIGS = {
    "llama": dict(num_hidden_layers=2, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen2": dict(num_hidden_layers=2),
    "qwen3": dict(num_hidden_layers=2, head_dim=16, tie_word_embeddings=True),
    "qwen2_moe": dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3_moe": dict(num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "deepseek_v3": dict(num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1, num_key_value_heads=4,
                        num_nextn_predict_layers=0,
                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
}
FAMILIES = tuple(FAMILY_CONFIGS)
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")


def save_tiny_model(family: str, directory: str, seed: int = 0, **overrides) -> str:
    """Save a random `family` model to `directory`; router biases get noise so they are not all zero."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**COMMON, **FAMILY_CONFIGS[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Random norms/biases too: default ones/zeros would hide a swapped mapping.
            if param.dim() == 1 or "e_score_correction_bias" in name:
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    return directory
