"""Architecture facts read from HF config.json files: shipped models, naming variants, and bad files."""
import json

import pytest

from rlmegatron.config import ArchitectureError, read_architecture
from tests.config.specs import MODELS_DIR


@pytest.mark.parametrize(
    "model, heads, kv_heads, layers, experts, expert_ffn, vocab",
    [
        ("qwen3-1.7b", 16, 8, 28, 0, None, 151936),
        ("qwen3-30b-a3b", 32, 4, 48, 128, 768, 151936),
        ("deepseek-v3", 128, 128, 61, 256, 2048, 129280),
        ("qwen2.5-0.5b", 14, 2, 24, 0, None, 151936),
        ("tiny-qwen3", 4, 2, 4, 0, None, 256),
        ("tiny-qwen3-moe", 4, 2, 4, 8, 32, 256),
    ],
)
def test_shipped_model_configs_read_as_published(model, heads, kv_heads, layers, experts, expert_ffn, vocab):
    arch = read_architecture(MODELS_DIR / model)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.num_hidden_layers) == (heads, kv_heads, layers)
    assert (arch.num_experts, arch.moe_intermediate_size, arch.vocab_size) == (experts, expert_ffn, vocab)
    assert arch.is_moe == (experts > 0)


def _write_config(tmp_path, **fields):
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    config.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("key", ["num_experts", "n_routed_experts", "num_local_experts"])
def test_every_expert_count_name_is_understood(tmp_path, key):
    arch = read_architecture(_write_config(tmp_path, **{key: 16}))
    assert arch.num_experts == 16


def test_mixtral_experts_are_sized_by_intermediate_size(tmp_path):
    arch = read_architecture(_write_config(tmp_path, num_local_experts=8, intermediate_size=14336))
    assert arch.moe_intermediate_size == 14336


def test_file_and_its_directory_read_the_same(tmp_path):
    config_file = _write_config(tmp_path, num_key_value_heads=2)
    assert read_architecture(config_file) == read_architecture(tmp_path)


def test_missing_kv_heads_means_one_per_attention_head(tmp_path):
    assert read_architecture(_write_config(tmp_path)).num_key_value_heads == 4


def test_multimodal_text_config_is_read(tmp_path):
    text = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "vocab_size": 50}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vlm", "text_config": text}))
    assert read_architecture(tmp_path).num_hidden_layers == 3


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ArchitectureError, match=f"no config.json at {tmp_path}/config.json"):
        read_architecture(tmp_path)


def test_invalid_json_is_an_architecture_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ArchitectureError, match="cannot read"):
        read_architecture(tmp_path)


def test_missing_required_field_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 9}))
    with pytest.raises(ArchitectureError, match="num_attention_heads must be a positive integer, got None"):
        read_architecture(path)
