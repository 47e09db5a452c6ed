"""Bad converter inputs fail early with errors that say what is wrong: non-HF dirs, missing shards, stray keys."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rlmegatron.models.convert import ConversionError, HFCheckpoint
from rlmegatron.models.hf_config import UnsupportedModelError, model_facts
from rlmegatron.models.weight_map import WeightMap, WeightMapError
from tests.models.tiny_hf import COMMON, FAMILY_CONFIGS


def _qwen2_facts():
    return model_facts({"model_type": "qwen2", **COMMON, **FAMILY_CONFIGS["qwen2"]}, tp=1)


def test_a_directory_without_config_json_is_not_a_hf_model(tmp_path):
    with pytest.raises(UnsupportedModelError, match="config.json"):
        HFCheckpoint(tmp_path)


def test_a_shard_named_by_the_index_but_absent_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **COMMON}))
    save_file({"model.norm.weight": torch.ones(64)}, tmp_path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="model-00002-of-00002.safetensors"):
        HFCheckpoint(tmp_path)


def test_hf_keys_no_rule_maps_are_listed():
    weight_map = WeightMap(_qwen2_facts())
    keys = weight_map.hf_keys() | {"model.layers.0.mlp.mystery.weight"}
    with pytest.raises(WeightMapError, match="mystery"):
        weight_map.check_hf_keys(keys)


def test_hf_keys_the_map_needs_but_lacks_are_listed():
    weight_map = WeightMap(_qwen2_facts())
    with pytest.raises(WeightMapError, match="model.norm.weight"):
        weight_map.check_hf_keys(weight_map.hf_keys() - {"model.norm.weight"})


def test_multi_token_prediction_layers_the_config_does_not_declare_are_refused_by_name():
    weight_map = WeightMap(_qwen2_facts())
    with pytest.raises(WeightMapError, match="multi-token-prediction"):
        weight_map.check_hf_keys(weight_map.hf_keys() | {f"model.layers.{weight_map.facts.num_layers}.eh_proj.weight"})


def test_an_mtp_copy_of_the_embedding_that_differs_from_it_is_refused_by_name():
    weight_map = WeightMap(model_facts({"model_type": "deepseek_v3", **COMMON, **FAMILY_CONFIGS["deepseek_v3"]}, tp=1))
    rule = weight_map.rule("embedding.word_embeddings.weight")
    embedding = torch.randn(200, 64)
    weight_map.check_copies(rule, embedding, lambda key: embedding.clone())
    with pytest.raises(WeightMapError, match=r"model\.layers\.4\.embed_tokens\.weight differs"):
        weight_map.check_copies(rule, embedding, lambda key: embedding + 1)


def test_full_tensor_map_round_trips_qkv_and_glu():
    weight_map = WeightMap(_qwen2_facts())
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    hf = {f"model.layers.0.self_attn.{n}_proj.weight": t for n, t in zip("qkv", (q, k, v))}
    fused = weight_map.hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", hf)
    # Group 0 first: its 2 query heads (32 rows), then its key head, then its value head.
    assert torch.equal(fused[:32], q[:32]) and torch.equal(fused[32:48], k[:16]) and torch.equal(fused[48:64], v[:16])
    assert all(torch.equal(hf[key], t) for key, t in
               weight_map.megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", fused).items())
