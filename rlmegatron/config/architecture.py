"""Reads the architecture facts the job spec checks need from a Hugging Face config.json (pure json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Families disagree on what to call the routed-expert count; the first present key wins.
_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


class ArchitectureError(ValueError):
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


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
    num_experts = next((count for key in _EXPERT_COUNT_KEYS if (count := optional(key))), 0)
    # Mixtral has no moe_intermediate_size: its experts are sized by intermediate_size.
    expert_ffn_size = optional("moe_intermediate_size") or (
        optional("intermediate_size") if num_experts else None
    )
    return ModelArchitecture(
        source=source,
        model_type=str(config.get("model_type", "")),
        hidden_size=required("hidden_size"),
        num_hidden_layers=required("num_hidden_layers"),
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
    )
