"""Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): a Qwen2 language model with multimodal rotary
positions (M-RoPE: each head's rotary dimensions split into temporal, height and width sections) and a ViT whose
merged patch embeddings replace the image placeholder tokens of the decoder input.

The language model is Megatron-Core's GPTModel (position_embedding_type "mrope"); the vision tower is transformers'
own module (models.vision), replicated on the first pipeline stage, so that its output is transformers' exactly.
config.json is read whole: transformers 5 saves the language model's keys under text_config, Qwen's own
checkpoints flat at the top level; both read the same here, and the file is written back as it was read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from rlmegatron.models.families.base import ArchitectureError, Rope, VisionTower, whole_number
from rlmegatron.models.families.qwen2 import Qwen2

# Qwen2_5_VLVisionConfig's defaults for the keys read here (tests/models/families check them against transformers).
VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16,
                   "out_hidden_size": 3584, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
                   "in_channels": 3, "hidden_act": "silu"}
# transformers' text rotary embedding falls back to this split when the config names none.
DEFAULT_MROPE_SECTION = (16, 24, 24)


class QwenVisionLanguage:
    """What Qwen's vision-language families share, mixed in before their language model's family (Qwen2 for
    Qwen2.5-VL, Qwen3 for Qwen3-VL): the config.json layout, M-RoPE, the vision tower read from vision_config and
    mapped under its checkpoint names. A family sets the class attributes below and how its tower is built."""

    rope_types = ("default", "mrope")  # Qwen's own config.json says type "mrope"; transformers 5 "default"
    position_embedding_type = "mrope"
    vision_defaults: Mapping[str, Any] = {}
    default_mrope_section: tuple[int, ...] = ()
    vision_tower_class = VisionTower
    reads_text_config = True

    def config(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The top level with the language model's keys lifted out of text_config, as the flat format has them."""
        text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else {}
        flat = {key: value for key, value in hf.items() if key != "text_config"}
        return super().config({**flat, **text, "model_type": hf.get("model_type", self.model_type)})

    def mrope_section(self, cfg: Mapping[str, Any]) -> tuple[int, ...]:
        return tuple(self.rope(cfg).params.get("mrope_section") or self.default_mrope_section)

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg)
        head_dim = whole_number(cfg, "head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        section = self.mrope_section(cfg)
        if 2 * sum(section) != head_dim:
            problems.append(f"rope_scaling.mrope_section={list(section)} covers {2 * sum(section)} rotary dimensions, "
                            f"not the head's {head_dim}")
        return problems

    def rope(self, cfg: Mapping[str, Any]) -> Rope:
        rope = super().rope(cfg)
        # Qwen's flat config.json marks M-RoPE as rope type "mrope"; its frequencies are the default ones.
        return Rope(theta=rope.theta, kind="default" if rope.kind == "mrope" else rope.kind, params=rope.params,
                    percent=rope.percent)

    def attention_fields(self, arch, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().attention_fields(arch, cfg), "mrope_section": list(self.mrope_section(cfg))}

    def vision(self, cfg: Mapping[str, Any], source: Path = Path("config.json")) -> VisionTower:
        vision = {**self.vision_defaults, **(cfg.get("vision_config") or {})}

        def positive(key: str) -> int:
            value = vision.get(key)
            if whole_number(vision, key) is None or value <= 0:
                raise ArchitectureError(f"{source}: vision_config.{key} must be a positive integer, got {value!r}")
            return value

        return self.vision_tower_class(
            depth=positive("depth"), hidden_size=positive("hidden_size"),
            intermediate_size=positive("intermediate_size"), num_heads=positive("num_heads"),
            out_hidden_size=positive("out_hidden_size"), patch_size=positive("patch_size"),
            temporal_patch_size=positive("temporal_patch_size"), spatial_merge_size=positive("spatial_merge_size"),
            in_channels=positive("in_channels"), image_token_id=int(cfg["image_token_id"]),
            vision_start_token_id=int(cfg["vision_start_token_id"]), **self.vision_fields(vision, positive, source))

    def vision_fields(self, vision: Mapping[str, Any], positive, source: Path) -> dict[str, Any]:
        """The family's own fields of its vision_tower_class, read from `vision` (vision_config with defaults)."""
        return {}

    def vision_rules(self, rules, vision: VisionTower) -> None:
        # The tower is transformers' module as it is (models.vision): its weights keep their names under
        # Megatron's `vision.` and the checkpoint's (and SGLang's) under hf_vision_prefix, unsharded.
        for name in vision.parameter_shapes():
            rules.add(f"vision.{name}", [f"{self.hf_vision_prefix}{name}"])


class Qwen2_5_VL(QwenVisionLanguage, Qwen2):
    model_type = "qwen2_5_vl"
    display_name = "Qwen2.5-VL"
    # Qwen2_5_VLTextConfig's defaults (Qwen2's but for rms_norm_eps and rope_theta), and the top level's.
    defaults = {**Qwen2.defaults, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "image_token_id": 151655,
                "vision_start_token_id": 151652}
    vision_defaults = VISION_DEFAULTS
    default_mrope_section = DEFAULT_MROPE_SECTION

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg)
        act = {**self.vision_defaults, **(cfg.get("vision_config") or {})}["hidden_act"]
        if act != "silu":
            # VisionTower.parameter_shapes names gate, up and down projections: the tower's SwiGLU MLPs.
            problems.append(f"vision_config.hidden_act={act!r} unsupported: the tower is bridged with SwiGLU MLPs")
        return problems

    def build_vision_tower(self, hf: Mapping[str, Any], dtype):
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        config = Qwen2_5_VLVisionConfig(**(hf.get("vision_config") or {}))
        return Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)


FAMILY = Qwen2_5_VL()
