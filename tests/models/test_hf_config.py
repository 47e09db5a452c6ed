"""HF config.json -> Megatron config derivation on the shipped real-shaped configs, and the clear refusals."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from rlmegatron.models.hf_config import UnsupportedModelError, model_facts, read_hf_config, transformer_config
from rlmegatron.runtime import ParallelLayout
from tests.models.tiny_hf import COMMON, FAMILIES, FAMILY_CONFIGS, VARIANTS

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def _derive(name_or_dict, layout=ParallelLayout()):
    hf = read_hf_config(CONFIGS / name_or_dict) if isinstance(name_or_dict, str) else name_or_dict
    return transformer_config(model_facts(hf, layout.tp), layout)


def _config_dir(model_type: str) -> str:
    return next(p.parent.name for p in CONFIGS.glob("*/config.json") if json.loads(p.read_text())["model_type"] == model_type)


def test_deepseek_v3_is_mla_with_dense_prefix_grouped_sigmoid_router_and_yarn():
    hf = read_hf_config(CONFIGS / _config_dir("deepseek_v3"))
    config = _derive(hf, ParallelLayout(ep=8))
    assert type(config).__name__ == "MLATransformerConfig"
    assert config.q_lora_rank == hf["q_lora_rank"] and config.kv_lora_rank == hf["kv_lora_rank"]
    k = hf["first_k_dense_replace"]
    assert config.moe_layer_freq == [0] * k + [1] * (hf["num_hidden_layers"] - k)
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (hf["n_group"], hf["topk_group"])
    assert config.moe_router_topk_scaling_factor == hf["routed_scaling_factor"]
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == hf["rope_scaling"]["factor"]
    assert config.moe_shared_expert_intermediate_size == hf["n_shared_experts"] * hf["moe_intermediate_size"]
    assert config.mtp_num_layers == hf["num_nextn_predict_layers"]


def test_qwen_families_carry_their_attention_and_router_flags():
    qwen3 = _derive(_config_dir("qwen3"))
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias
    qwen25 = _derive(_config_dir("qwen2"))
    assert qwen25.add_qkv_bias and not qwen25.qk_layernorm
    hf = read_hf_config(CONFIGS / _config_dir("qwen3_moe"))
    moe = _derive(hf, ParallelLayout(ep=4))
    assert moe.num_moe_experts == hf["num_experts"] and moe.moe_router_topk == hf["num_experts_per_tok"]
    assert moe.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the chosen experts


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, "lacks low_freq_factor"),
        ({"use_sliding_window": True}, "sliding_window"),
    ],
)
def test_unsupported_values_name_the_field(change, field):
    hf = {**read_hf_config(CONFIGS / _config_dir("qwen3")), **change}
    with pytest.raises(UnsupportedModelError, match=field):
        _derive(hf)


def test_expert_count_not_divisible_by_ep_is_refused():
    with pytest.raises(UnsupportedModelError, match="EP=3"):
        _derive(_config_dir("qwen3_moe"), ParallelLayout(ep=3))


@pytest.mark.parametrize("variant", ["llama3.2_rope", "llama_custom_rope"])
def test_llama3_rope_frequencies_are_transformers_for_all_four_fields(variant):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from rlmegatron.models.hf_config import _scale_llama3_rope

    config = AutoConfig.for_model("llama", **{**COMMON, **FAMILY_CONFIGS["llama"], **VARIANTS[variant].config})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    facts = model_facts(config.to_dict(), tp=1)

    def rotary(**scaling):
        return RotaryEmbedding(kv_channels=config.head_dim, rotary_percent=1.0, rotary_base=int(facts.rotary_base),
                               use_cpu_initialization=True, **scaling)

    ours = rotary()
    _scale_llama3_rope(ours, facts.llama3_rope_scaling)
    torch.testing.assert_close(ours.inv_freq, expected, rtol=1e-6, atol=0)
    # Megatron-Core's own scaling takes only the factor: right for Llama-3.2's fields, wrong for the others.
    megatron_own = rotary(rope_scaling=True, rope_scaling_factor=facts.llama3_rope_scaling["factor"]).inv_freq
    assert torch.allclose(megatron_own, expected, rtol=1e-6, atol=0) == (variant == "llama3.2_rope")


# What rlmegatron merely picks for the user, which megatron.extra may change; every other field it sets is
# RESERVED (config.transformer_config), so `rlm validate` names where it comes from instead of overriding it.
USER_CHOICES = {"hidden_dropout", "attention_dropout", "use_cpu_initialization", "moe_token_dispatcher_type",
                "moe_grouped_gemm", "moe_aux_loss_coeff", "moe_router_dtype"}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_field_rlmegatron_sets_is_reserved_or_a_user_choice(model_type, monkeypatch):
    from megatron.core import transformer

    from rlmegatron.config.transformer_config import RESERVED

    from tests.models.recompute_jobs import hf_config

    passed = {}
    for name in ("TransformerConfig", "MLATransformerConfig"):
        # The config the fields would build: a namespace, so that the family's config attributes (YaRN's) land.
        monkeypatch.setattr(transformer, name, lambda **fields: passed.update(fields) or types.SimpleNamespace())
    _derive(hf_config(model_type), ParallelLayout(pp=2, first_stage_layers=1))
    layout_split = {"num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"}  # from extra
    assert set(passed) - set(RESERVED) - layout_split == USER_CHOICES & set(passed)


def test_spec_recompute_and_extra_reach_the_transformer_config():
    from rlmegatron.config.spec import MegatronConfig
    from rlmegatron.driver.role_settings import parallel_layout
    from rlmegatron.models.hf_config import spec_config_options
    from tests.models.recompute_jobs import hf_config

    hf = hf_config("qwen3_moe", num_hidden_layers=4)
    megatron = MegatronConfig(pipeline_model_parallel_size=2, recompute_granularity="full", recompute_method="block",
                              recompute_num_layers=3, extra={"moe_aux_loss_coeff": 0.01, "moe_token_dispatcher_type":
                                                             "allgather", "num_layers_in_last_pipeline_stage": 3})
    config = transformer_config(model_facts(hf, 1), parallel_layout(megatron), options=spec_config_options(megatron))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 3)
    assert (config.moe_aux_loss_coeff, config.moe_token_dispatcher_type) == (0.01, "allgather")
    assert (config.pipeline_model_parallel_size, config.num_layers_in_last_pipeline_stage) == (2, 3)
    selective = transformer_config(model_facts(hf, 1), ParallelLayout(),
                                   options=spec_config_options(MegatronConfig(recompute_granularity="selective")))
    assert (selective.recompute_granularity, selective.recompute_method, selective.recompute_num_layers) == (
        "selective", None, None)
