"""Each family reads its config.json as transformers' own code does: the defaults of the keys it reads, and the
modules transformers builds from a config (q/k/v and o_proj biases, query/key norms, head size, expert count, which
layers are MoE). Every case builds the tiny HF model and compares with the family's reading of its config."""
from __future__ import annotations

import pytest
import torch

from rlmegatron.models.families import FAMILIES, UnsupportedModelError, architecture_of, family_for
from rlmegatron.rollout.buckets import travel_rules_for
from tests.models.tiny_hf import COMMON, FAMILY_CONFIGS


def _transformers_default(config, key: str):
    """A transformers config's value for `key`; transformers 5 keeps rope_theta and partial_rotary_factor in
    rope_parameters, and a vision-language config the language model's keys in its text_config."""
    text = getattr(config, "text_config", None)
    if text is not None and not hasattr(config, key):
        config = text
    if key in ("rope_theta", "partial_rotary_factor"):
        return config.rope_parameters[key]
    return getattr(config, key)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_defaults_and_aliases_are_transformers_own(model_type):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    family = FAMILIES[model_type]
    assert {key: _transformers_default(config, key) for key in family.defaults} == dict(family.defaults)
    assert dict(family.aliases) == type(config.get_text_config()).attribute_map  # the language model's keys


def _config(model_type: str, **changes) -> dict:
    return {"model_type": model_type, **COMMON, **FAMILY_CONFIGS[model_type], **changes}


def _hf_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {key: value for key, value in config.items() if key != "model_type"}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields), dtype=torch.float32)


def _is_moe(layer) -> bool:
    return any(name.endswith("experts") for name, _ in layer.mlp.named_children()) or hasattr(layer, "block_sparse_moe")


# Config values whose reading the families disagreed on before they were one reader each: Qwen2 builds q/k/v biases
# whatever attention_bias says, Qwen2-MoE follows qkv_bias, Mixtral never has any; a Qwen-MoE's mlp_only_layers
# holds whatever decoder_sparse_step says; Qwen3's head_dim is 128 unless set; DeepSeek-V3's dense prefix is
# first_k_dense_replace alone; a config.json may name the expert count by transformers' alias of its key; GLM-4.5's
# attention switches and the share of each head it rotates.
VARIANTS = [
    ("llama", {}), ("llama", {"attention_bias": True}), ("qwen2", {"attention_bias": False}),
    ("qwen3", {}), ("qwen3", {"head_dim": None}), ("qwen3", {"attention_bias": True}),
    ("qwen2_moe", {}), ("qwen2_moe", {"qkv_bias": False}), ("qwen2_moe", {"mlp_only_layers": [0]}),
    ("qwen3_moe", {"decoder_sparse_step": 2}), ("qwen3_moe", {"mlp_only_layers": [1], "num_hidden_layers": 3}),
    ("qwen3_moe", {"num_experts": None, "num_local_experts": 4}), ("mixtral", {"attention_bias": True}),
    ("mixtral", {"num_local_experts": None, "num_experts": 4}), ("deepseek_v3", {}),
    ("deepseek_v3", {"first_k_dense_replace": 2}), ("glm4_moe", {}),
    ("glm4_moe", {"attention_bias": False, "use_qk_norm": False, "first_k_dense_replace": 0,
                  "partial_rotary_factor": None}),  # GLM rotates half of each head unless told otherwise
    ("glm4_moe", {"partial_rotary_factor": None,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
    # MiniMax-M2's rotated share as released (rotary_dim) and as transformers 5 writes it (rope_parameters).
    ("minimax_m2", {}), ("minimax_m2", {"rotary_dim": None, "rope_parameters": {
        "rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}}),
]


@pytest.mark.parametrize("model_type, changes", VARIANTS, ids=[f"{t}-{c}" for t, c in VARIANTS])
def test_the_family_reads_what_transformers_builds(model_type, changes):
    # None: the key is absent from config.json (transformers' default, or an alias, applies).
    config = {key: value for key, value in _config(model_type, **changes).items() if value is not None}
    arch = architecture_of(config)
    model = _hf_model(config)
    layers = model.model.layers
    attention = layers[0].self_attn
    family = FAMILIES[model_type]
    if arch.mla is None:
        assert (attention.q_proj.bias is not None, attention.k_proj.bias is not None) == (arch.qkv_bias, arch.qkv_bias)
        assert hasattr(attention, "q_norm") == arch.qk_norm
        assert attention.q_proj.out_features == arch.num_attention_heads * arch.head_dim
        rotated = 2 * model.model.rotary_emb.inv_freq.numel()
        assert rotated == int(arch.head_dim * family.rope(family.config(config)).percent)
    assert tuple(_is_moe(layer) for layer in layers) == arch.moe_layers
    experts = next((module for layer in layers for name, module in layer.named_modules() if name.endswith("experts")),
                   None)
    assert (experts.num_experts if experts is not None else 0) == arch.num_experts
    # A bias transformers puts on o_proj (Llama's, Qwen3's attention_bias) has no Megatron counterpart: refused.
    o_proj_bias = getattr(attention, "o_proj", None) is not None and attention.o_proj.bias is not None
    problems = family.problems(family.config(config))
    assert any("o_proj" in problem for problem in problems) == o_proj_bias


def test_values_the_bridge_cannot_express_are_named_together_in_one_line():
    with pytest.raises(UnsupportedModelError) as refused:
        FAMILIES["llama"].check(_config("llama", hidden_act="gelu", mlp_bias=True))
    message = str(refused.value)
    assert "\n" not in message and "hidden_act='gelu' unsupported" in message and "mlp_bias=True unsupported" in message
    # Megatron groups DeepSeek's experts by their num_experts_per_tok / topk_group best scores, transformers by 2.
    with pytest.raises(UnsupportedModelError, match="topk_group=1 unsupported"):
        FAMILIES["deepseek_v3"].check(_config("deepseek_v3", num_experts_per_tok=3))


def test_a_model_type_no_family_claims_is_read_for_its_shape_only():
    arch = architecture_of({"model_type": "olmoe", **COMMON, "num_experts": 8, "num_hidden_layers": 2})
    assert arch.num_experts == 8 and arch.moe_layers == (True, True)
    assert family_for("olmoe") is not family_for("qwen3_moe") and "olmoe" not in FAMILIES


def test_deepseeks_fused_query_and_kv_down_projections_travel_together_and_nothing_else_does():
    (rule,) = travel_rules_for(_config("deepseek_v3"))
    assert rule.group_of("model.layers.3.self_attn.q_a_proj.weight") == ("model.layers.3.self_attn.*.weight", "q_a_proj")
    assert rule.group_of("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")[1] == "kv_a_proj_with_mqa"
    assert rule.group_of("model.layers.3.self_attn.q_b_proj.weight") is None
    assert travel_rules_for(_config("deepseek_v3", q_lora_rank=None)) == ()  # DeepSeek-V2-Lite's direct query
    # Kimi-K2.5's language model is DeepSeek-V3's, which SGLang fuses alike.
    (kimi,) = travel_rules_for({"model_type": "kimi_k25", **FAMILY_CONFIGS["kimi_k25"]})
    assert kimi.group_of("language_model.model.layers.1.self_attn.q_a_proj.weight")[1] == "q_a_proj"
    # DeepSeek-V3.2's and GLM-5's too (DeepSeek-V3's MLA); no other family's.
    mla = ("deepseek_v3", "kimi_k25", "deepseek_v32", "glm_moe_dsa")
    assert all(len(travel_rules_for(_config(t))) == 1 for t in mla[2:])
    assert all(travel_rules_for(_config(t)) == () for t in FAMILY_CONFIGS if t not in mla)
