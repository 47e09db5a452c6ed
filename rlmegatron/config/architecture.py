"""Reads the architecture facts the spec checks and the planner need from a Hugging Face config.json (pure json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlmegatron.errors import UserError

# Families disagree on what to call the routed-expert count; the first present key wins.
_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
# Qwen2 has q/k/v biases but its config.json has no attention_bias key to say so.
_ALWAYS_QKV_BIAS = frozenset({"qwen2", "qwen2_moe"})
# Qwen3 normalises each query and key head (q_norm, k_norm); no config key says so.
_QK_NORM = frozenset({"qwen3", "qwen3_moe"})


class ArchitectureError(UserError, ValueError):
    """The config.json is missing, is not JSON, or lacks a field every decoder has."""


@dataclass(frozen=True)
class ModelArchitecture:
    """Shape of a decoder-only transformer as its HF config.json states it."""

    source: Path
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int | None
    num_experts: int  # routed experts; 0 for a dense model
    moe_intermediate_size: int | None  # hidden size of one routed expert's MLP
    num_experts_per_tok: int | None
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    # Fields below only size the model (rlm plan); the spec checks do not need them.
    head_dim: int = 0  # per attention head; HF's default is hidden_size / num_attention_heads
    qkv_bias: bool = False
    qk_norm: bool = False
    num_moe_layers: int = 0  # layers whose MLP is routed (DeepSeek's first_k_dense_replace stay dense)
    shared_expert_intermediate_size: int = 0  # all shared experts of a layer together; 0 when none
    shared_expert_gate: bool = False  # Qwen2-MoE scales its shared expert by a learned sigmoid gate
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    mla: MultiLatentAttention | None = None
    num_mtp_layers: int = 0  # DeepSeek's multi-token-prediction layers: in the checkpoint, not trained in RL

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class MultiLatentAttention:
    """DeepSeek's MLA projection sizes; q_lora_rank is None when queries are projected directly."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def read_architecture(path: str | Path) -> ModelArchitecture:
    """Read `path` (a config.json, or a directory holding one) into a ModelArchitecture."""
    config_file = Path(path)
    if config_file.is_dir():
        config_file = config_file / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArchitectureError(f"no config.json at {config_file}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArchitectureError(f"cannot read {config_file}: {err}") from None
    if not isinstance(config, dict):
        raise ArchitectureError(f"{config_file} does not hold a JSON object")
    # Multimodal checkpoints (Qwen2.5-VL, Gemma 3, Llama 4) nest the language model here.
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    return _architecture_from(config, config_file)


def _architecture_from(config: dict, source: Path) -> ModelArchitecture:
    def required(key: str) -> int:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ArchitectureError(f"{source}: {key} must be a positive integer, got {value!r}")
        return value

    def optional(key: str) -> int | None:
        value = config.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    num_attention_heads = required("num_attention_heads")
    hidden_size = required("hidden_size")
    num_layers = required("num_hidden_layers")
    model_type = str(config.get("model_type", ""))
    num_experts = next((count for key in _EXPERT_COUNT_KEYS if (count := optional(key))), 0)
    # Mixtral has no moe_intermediate_size: its experts are sized by intermediate_size.
    expert_ffn_size = optional("moe_intermediate_size") or (
        optional("intermediate_size") if num_experts else None
    )
    shared_size = optional("shared_expert_intermediate_size") or (
        (optional("n_shared_experts") or 0) * (expert_ffn_size or 0)
    )
    return ModelArchitecture(
        source=source,
        model_type=model_type,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        # HF leaves this out when every head has its own key/value (plain multi-head attention).
        num_key_value_heads=optional("num_key_value_heads") or num_attention_heads,
        vocab_size=required("vocab_size"),
        intermediate_size=optional("intermediate_size"),
        num_experts=num_experts,
        moe_intermediate_size=expert_ffn_size,
        num_experts_per_tok=optional("num_experts_per_tok"),
        max_position_embeddings=optional("max_position_embeddings"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=optional("head_dim") or hidden_size // num_attention_heads,
        qkv_bias=bool(config.get("attention_bias", model_type in _ALWAYS_QKV_BIAS)),
        qk_norm=model_type in _QK_NORM,
        num_moe_layers=_count_moe_layers(config, num_layers) if num_experts else 0,
        shared_expert_intermediate_size=shared_size,
        shared_expert_gate=bool(optional("shared_expert_intermediate_size")),
        router_bias=config.get("topk_method") == "noaux_tc",
        mla=_multi_latent_attention(config),
        num_mtp_layers=optional("num_nextn_predict_layers") or 0,
    )


def _count_moe_layers(config: dict, num_layers: int) -> int:
    """Layers with routed experts, by DeepSeek's (first_k_dense_replace, moe_layer_freq) or Qwen's rules."""
    first_dense = config.get("first_k_dense_replace") or 0
    every = config.get("moe_layer_freq") or config.get("decoder_sparse_step") or 1
    dense_only = set(config.get("mlp_only_layers") or [])
    if "decoder_sparse_step" in config:  # Qwen-MoE: layer i is sparse when (i + 1) % step == 0
        return sum(1 for i in range(num_layers) if i not in dense_only and (i + 1) % every == 0)
    return sum(1 for i in range(first_dense, num_layers) if i % every == 0)


def _multi_latent_attention(config: dict) -> MultiLatentAttention | None:
    if not isinstance(config.get("kv_lora_rank"), int):
        return None
    return MultiLatentAttention(
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
    )
