"""Tiny random-weight HF checkpoints of every bridged family, saved with transformers' own save_pretrained."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from rlmegatron.models.families import architecture_of

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=200,
              max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILY_CONFIGS = {
    # Four layers where the conversion matrix runs the interleaved pipeline (a layer per virtual stage).
    "llama": dict(num_hidden_layers=4, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen2": dict(num_hidden_layers=4),
    "qwen3": dict(num_hidden_layers=2, head_dim=16, tie_word_embeddings=True),
    "qwen2_moe": dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3_moe": dict(num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "deepseek_v3": dict(num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1, num_key_value_heads=4,
                        num_nextn_predict_layers=1,
                        # As DeepSeek releases them (transformers ignores them, SGLang's model reads them).
                        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    # GLM-4.5's switches on: q/k/v biases, query/key norms, half of each head rotated, scaled routing, an MTP layer.
    "glm4_moe": dict(num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                     attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, num_nextn_predict_layers=1),
    # MiniMax-M2's query/key norms over all heads, a quarter of each head rotated (rotary_dim, as released).
    "minimax_m2": dict(num_hidden_layers=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                       intermediate_size=32, rotary_dim=4, bos_token_id=1, eos_token_id=2, scoring_func="sigmoid",
                       use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer"),
    # gpt-oss: sinks, a sliding window of 4 keys on layer 0 (full attention on layer 1), YaRN with transformers'
    # truncate off, biased experts stacked [E, in, out] with gate and up interleaved, their SwiGLU clamped.
    "gpt_oss": dict(num_hidden_layers=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=4, swiglu_limit=0.05,  # cuts 40 % of the gates and 80 % of the ups
                    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0)),
    # DeepSeek-V3.2: DeepSeek-V3 with a lightning indexer whose top 6 keys each query attends to (of 16 positions).
    "deepseek_v32": dict(num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1, num_key_value_heads=4,
                         index_topk=6, index_head_dim=16, index_n_heads=4, num_nextn_predict_layers=0,
                         moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",  # as released
                         rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                           beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    # GLM-5: the same sparse attention, its indexer rotating interleaved pairs.
    "glm_moe_dsa": dict(num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        first_k_dense_replace=1, n_shared_experts=1, num_key_value_heads=4, index_topk=6,
                        index_head_dim=16, index_n_heads=4, num_nextn_predict_layers=0, moe_layer_freq=1,
                        topk_method="noaux_tc", scoring_func="sigmoid",
                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    # Kimi-K2.5: a DeepSeek-V3 language model (text_config) in a vision-language wrapper whose MoonViT tower and
    # projector the bridge carries as they are.
    "kimi_k25": dict(text_config=dict(
        model_type="kimi_k2", **{**COMMON, "num_key_value_heads": 4}, num_hidden_layers=2, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1,
        num_nextn_predict_layers=0, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
        vision_config=dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=48,
                           pos_emb_height=4, pos_emb_width=4, pos_emb_time=2),
        projection_hidden_size=32, tie_word_embeddings=False),
    # Qwen3-Next: a Gated DeltaNet layer (2 key heads, each read by 2 value heads) then a gated full-attention one,
    # zero-centred norms, routed MLPs with a gated shared expert.
    "qwen3_next": dict(num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, full_attention_interval=2,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8),
    # Qwen3.5-MoE: the same decoder, unfused projections, nested in a vision-language wrapper whose tower is carried.
    "qwen3_5_moe": dict(text_config=dict(
        model_type="qwen3_5_moe_text", **COMMON, num_hidden_layers=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=4, num_position_embeddings=16)),
}
# Families whose config.json nests the language model in text_config (COMMON goes there, not at the top level).
NESTED = ("kimi_k25", "qwen3_5_moe")
FAMILIES = tuple(FAMILY_CONFIGS)
MOE_FAMILIES = tuple(f for f in FAMILIES if architecture_of({"model_type": f, **COMMON, **FAMILY_CONFIGS[f]}).is_moe)


@dataclass(frozen=True)
class Variant:
    """A checkpoint of `family` as users have it, with `config` over the family's tiny config."""

    family: str
    config: dict
    mtp_tensors: bool = True  # MTP layers as DeepSeek and GLM ship them; False: as transformers saves them


def _llama3_rope(factor: float, low: float, high: float, original: int, theta: float) -> dict:
    return dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                original_max_position_embeddings=original, rope_theta=theta)


VARIANTS = {
    # Llama-3.2's rope scaling (1B/3B config.json), and one with none of Llama-3.1's constants whose
    # frequencies, unlike those, are scaled well within the 16 positions the logits are compared at.
    "llama3.2_rope": Variant("llama", dict(max_position_embeddings=131072,
                                           rope_scaling=_llama3_rope(32.0, 1.0, 4.0, 8192, theta=500000.0))),
    "llama_custom_rope": Variant("llama", dict(max_position_embeddings=1024,
                                               rope_scaling=_llama3_rope(16.0, 2.0, 8.0, 256, theta=10000.0))),
    # num_nextn_predict_layers says 1, but transformers neither builds nor saves MTP layers.
    "deepseek_v3_no_mtp": Variant("deepseek_v3", {}, mtp_tensors=False),
}


def family_of(name: str) -> str:
    return VARIANTS[name].family if name in VARIANTS else name


def saved_mtp_layers(name: str) -> int:
    """The multi-token-prediction layers save_tiny_model(name) writes."""
    variant = VARIANTS.get(name, Variant(name, {}))
    return FAMILY_CONFIGS[variant.family].get("num_nextn_predict_layers", 0) if variant.mtp_tensors else 0


def save_tiny_model(name: str, directory: str, seed: int = 0, **overrides) -> str:
    """Save a random model of family or VARIANTS entry `name` to `directory`; router biases get noise so they are
    not all zero."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    variant = VARIANTS.get(name, Variant(name, {}))
    common = {} if variant.family in NESTED else COMMON
    config = AutoConfig.for_model(variant.family, **{**common, **FAMILY_CONFIGS[variant.family], **variant.config,
                                                     **overrides})
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if variant.family in NESTED else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Random norms/biases too (MiniMax-M2's expert bias is a buffer): default ones/zeros would hide a swapped
        # mapping.
        saved = model.state_dict().keys()
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if (param.dim() == 1 and name in saved) or name.endswith("_bias"):
                param.copy_(_random_norm_or_bias(name, param))
    model.save_pretrained(directory)
    if variant.family == "kimi_k25":
        as_kimi_releases_it(directory)
    if variant.family in ("qwen3_next", "qwen3_5_moe"):
        as_qwen_releases_hybrids(directory)
    if getattr(config, "num_nextn_predict_layers", 0) and variant.mtp_tensors:
        _append_mtp_layers(directory, config)
    return directory


def as_kimi_releases_it(directory: str) -> None:
    """transformers 5.24 saves Kimi-K2.5's language model layers as `blocks` (its renaming of the vision tower's
    blocks, reversed over every key); Moonshot's checkpoint, which its loading reads, names them `layers`. Moonshot's
    config.json names its own class, which SGLang's Kimi-K2.5 model registers under."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(directory, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "architectures": ["KimiK25ForConditionalGeneration"]}, f, indent=1)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    save_file({key.replace("language_model.model.blocks.", "language_model.model.layers."): value
               for key, value in tensors.items()}, path, metadata={"format": "pt"})


def as_qwen_releases_hybrids(directory: str) -> None:
    """Qwen's Qwen3-Next and Qwen3.5 config.json files state full_attention_interval beside layer_types, which
    SGLang's config classes read (transformers drops it on save): the tiny models' layers alternate, interval 2. Their
    checkpoints hold an MTP layer under mtp.*, which transformers neither builds nor saves: its own tensors are
    added (random), as the bridge carries them."""
    from safetensors.torch import load_file, save_file

    config_file = os.path.join(directory, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    assert text["layer_types"] == ["linear_attention", "full_attention"] * (len(text["layer_types"]) // 2)
    text["full_attention_interval"] = 2
    with open(config_file, "w") as f:
        json.dump(config, f, indent=1)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    hidden = text["hidden_size"]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = _random_norm_or_bias("norm", torch.empty(hidden))
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
    save_file(tensors, path, metadata={"format": "pt"})


def _random_norm_or_bias(name: str, like: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(like) * 0.1 + (1.0 if "norm" in name else 0.0)


def _append_mtp_layers(directory: str, config) -> None:
    """Add multi-token-prediction layers to the saved checkpoint, as DeepSeek and GLM ship them (transformers
    neither builds nor saves them): random weights shaped like the last decoder layer's, the MTP-only tensors,
    and copies of the main embedding and head."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    hidden = config.hidden_size
    for k in range(config.num_nextn_predict_layers):
        mtp = f"model.layers.{config.num_hidden_layers + k}."
        for key in [key for key in tensors if key.startswith(last)]:
            weight = tensors[key]
            name = mtp + key.removeprefix(last)
            tensors[name] = _random_norm_or_bias(name, weight) if weight.dim() == 1 else torch.randn_like(weight) * 0.05
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{mtp}{norm}.weight"] = _random_norm_or_bias("norm", torch.empty(hidden))
        tensors[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
        tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def save_quickstart_mtp_model(directory: str, mtp_tensors: bool = True, seed: int = 0) -> str:
    """The tiny DeepSeek-V3 with one MTP layer (FAMILY_CONFIGS) on the quickstart's tokenizer (its 128 tokens), so a
    spec built on configs/quickstart.yaml runs it; `mtp_tensors=False`: the same main weights as transformers saves
    them, without the MTP layer."""
    import shutil

    quickstart = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart", "model")
    save_tiny_model("deepseek_v3" if mtp_tensors else "deepseek_v3_no_mtp", directory, seed=seed, vocab_size=128,
                    pad_token_id=0, eos_token_id=4, bos_token_id=None, max_position_embeddings=128)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(quickstart, name), directory)
    return directory
