"""One module per model family: everything rlmegatron knows about it, found by its model_type.

A family module (llama.py, qwen3.py, deepseek_v3.py, ...) sets `FAMILY`, a models.families.base.Family that
reads the family's config.json (architecture facts, what the bridge cannot express), names its Megatron-Core
config fields and layer spec, its weight-map rules (MTP, MLA, expert layout) and its export quirks. Adding a family
is adding its module here (named as its model_type) and its tiny test config (tests/models/tiny_hf.py).

Everything here is pure Python: the spec checks and the planner read architectures through it without torch.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any, Collection, Mapping

from rlmegatron.models.families.base import (
    ArchitectureError,
    Family,
    ModelArchitecture,
    MultiLatentAttention,
    UnsupportedModelError,
    whole_number,
)


def _discover() -> dict[str, Family]:
    families = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
            assert family.model_type == module.name, f"{module.name}.py holds model_type {family.model_type!r}"
            families[family.model_type] = family
    return families


FAMILIES: dict[str, Family] = _discover()


class _Unbridged(Family):
    """Reads a model_type no family claims, for the shape facts the spec checks and the planner need, by the
    conventions of the families there are; such a model cannot be trained here (bridged_family says so)."""

    def num_experts(self, cfg: Mapping[str, Any]) -> int:
        # Families disagree on what to call the routed-expert count; the first present key wins.
        keys = ("num_experts", "n_routed_experts", "num_local_experts")
        return next((count for key in keys if (count := whole_number(cfg, key))), 0)

    def moe_layers(self, cfg: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
        # DeepSeek's first_k_dense_replace and moe_layer_freq, Qwen-MoE's mlp_only_layers and decoder_sparse_step.
        first_dense = cfg.get("first_k_dense_replace") or 0
        every, step = cfg.get("moe_layer_freq") or 1, cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        return tuple(i >= first_dense and i % every == 0 and (i + 1) % step == 0 and i not in dense
                     for i in range(num_layers))

    def shared_experts(self, cfg: Mapping[str, Any], expert_ffn_size: int) -> tuple[int, bool]:
        gated = whole_number(cfg, "shared_expert_intermediate_size")
        return gated or (whole_number(cfg, "n_shared_experts") or 0) * expert_ffn_size, bool(gated)

    def router_bias(self, cfg: Mapping[str, Any]) -> bool:
        return cfg.get("topk_method") == "noaux_tc"

    def mla(self, cfg: Mapping[str, Any]) -> MultiLatentAttention | None:
        if not isinstance(cfg.get("kv_lora_rank"), int):
            return None
        return MultiLatentAttention(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                                    qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                                    v_head_dim=cfg["v_head_dim"])

    def num_mtp_layers(self, cfg: Mapping[str, Any]) -> int:
        return whole_number(cfg, "num_nextn_predict_layers") or 0


_UNBRIDGED = _Unbridged()


def family_for(model_type: Any) -> Family:
    """The family of `model_type`; for one no family claims, a reader of its shape facts only."""
    return FAMILIES.get(model_type, _UNBRIDGED)


def bridged_family(hf: Mapping[str, Any]) -> Family:
    """The family of the model `hf` describes; UnsupportedModelError when rlmegatron cannot train it."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def architecture_of(config: Mapping[str, Any], source: Path = Path("config.json")) -> ModelArchitecture:
    """The architecture facts of a (text) config.json's contents, read by its family."""
    return family_for(config.get("model_type")).architecture(config, source)


def read_config_json(path: str | Path) -> tuple[dict[str, Any], Path]:
    """(contents, file) of the config.json at `path` (the file or its directory), a multimodal checkpoint's
    text_config unwrapped; ArchitectureError when it is missing or not a JSON object."""
    config_file = Path(path)
    if config_file.is_dir():
        config_file = config_file / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArchitectureError(f"no config.json at {config_file}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArchitectureError(f"cannot read {config_file}: not a JSON config ({err})") from None
    except OSError as err:
        raise ArchitectureError(f"cannot read {config_file}: {err}") from None
    if not isinstance(config, dict):
        raise ArchitectureError(f"{config_file} does not hold a JSON object")
    # Multimodal checkpoints (Gemma 3, Llama 4) nest the language model here; a bridged vision-language family
    # (Qwen2.5-VL, Kimi-K2.5) reads the whole file itself, its vision_config included.
    whole = config.get("model_type") in FAMILIES and FAMILIES[config["model_type"]].reads_text_config
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict) and not whole:
        config = config["text_config"]
    return config, config_file


def read_architecture(path: str | Path) -> ModelArchitecture:
    """Read `path` (a config.json, or a directory holding one) into a ModelArchitecture."""
    config, config_file = read_config_json(path)
    return architecture_of(config, config_file)


def mtp_layers_in(arch: ModelArchitecture, keys: Collection[str]) -> int:
    """MTP layers a checkpoint with these tensor names holds: the declared ones, or none when the first is absent
    (a DeepSeek-V3 saved by transformers, which does not implement MTP, says 1 and has none)."""
    first = f"model.layers.{arch.num_hidden_layers}."
    return arch.num_mtp_layers if arch.num_mtp_layers and any(key.startswith(first) for key in keys) else 0


def checkpoint_mtp_layers(arch: ModelArchitecture, directory: str | Path) -> int:
    """MTP layers the HF checkpoint in `directory` holds (mtp_layers_in), read from its index or its one file's
    header alone, so that `rlm validate` answers without loading a weight; as config.json declares where the
    directory holds no safetensors (a random_init model, a config.json alone)."""
    directory = Path(directory)
    index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
    if index.is_file():
        keys = json.loads(index.read_text()).get("weight_map", {})
    elif single.is_file():
        from safetensors import safe_open  # lazy: only a one-file checkpoint needs its header read

        with safe_open(single, framework="numpy") as handle:
            keys = list(handle.keys())
    else:
        return arch.num_mtp_layers
    return mtp_layers_in(arch, keys)


def built_mtp_layers(arch: ModelArchitecture, path: str, random_init: bool) -> int:
    """The MTP layers Megatron builds for model.path `path`: as config.json declares for random weights or a path
    that is not a local directory (a hub id beside model.hf_config), else as many as its checkpoint holds."""
    if random_init or not Path(path).is_dir():
        return arch.num_mtp_layers
    return checkpoint_mtp_layers(arch, path)


__all__ = ["ArchitectureError", "FAMILIES", "Family", "ModelArchitecture", "MultiLatentAttention",
           "UnsupportedModelError", "architecture_of", "bridged_family", "family_for", "read_architecture",
           "read_config_json", "mtp_layers_in", "checkpoint_mtp_layers", "built_mtp_layers"]
