"""Qwen3-VL (transformers' Qwen3VLForConditionalGeneration): a Qwen3 language model (query/key norms) with
interleaved M-RoPE and a ViT whose merged patch embeddings replace the image placeholder tokens, as Qwen2.5-VL's
do (models.families.qwen2_5_vl.QwenVisionLanguage: config.json, positions, data and image batches are the same),
and DeepStack: mergers on some of the tower's blocks give the image tokens features that are added to their hidden
states after the first decoder layers, one merger per layer (models.vision.VisionLanguageModel).

transformers 5 saves it as Qwen ships it, under model.language_model. and model.visual., which SGLang's Qwen3-VL
loader takes as they are; the weight map keeps those names.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rlmegatron.models.families.base import ArchitectureError, Family, VisionTower
from rlmegatron.models.families.qwen2_5_vl import QwenVisionLanguage
from rlmegatron.models.families.qwen3 import Qwen3


@dataclass(frozen=True)
class Qwen3VisionTower(VisionTower):
    """Qwen3-VL's ViT: a biased patch embedding plus a learned position grid (interpolated to each image), LayerNorm
    blocks with plain two-layer MLPs, the merger, and one DeepStack merger per entry of deepstack_visual_indexes
    (the tower blocks whose output it merges; its features go to decoder layer 0, 1, ... in that order)."""

    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def deepstack_layers(self) -> int:
        return len(self.deepstack_visual_indexes)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, m, out = self.hidden_size, self.intermediate_size, self.merged_hidden_size, self.out_hidden_size

        def linear(name: str, rows: int, columns: int) -> dict[str, tuple[int, ...]]:
            return {f"{name}.weight": (rows, columns), f"{name}.bias": (rows,)}

        def norm(name: str, size: int) -> dict[str, tuple[int, ...]]:
            return {f"{name}.weight": (size,), f"{name}.bias": (size,)}

        def merger(name: str, norm_size: int) -> dict[str, tuple[int, ...]]:
            return {**norm(f"{name}.norm", norm_size), **linear(f"{name}.linear_fc1", m, m),
                    **linear(f"{name}.linear_fc2", out, m)}

        shapes = {"patch_embed.proj.weight": (h, self.in_channels, self.temporal_patch_size, self.patch_size,
                                              self.patch_size),
                  "patch_embed.proj.bias": (h,), "pos_embed.weight": (self.num_position_embeddings, h)}
        for block in range(self.depth):
            b = f"blocks.{block}."
            shapes.update({**norm(b + "norm1", h), **norm(b + "norm2", h), **linear(b + "attn.qkv", 3 * h, h),
                           **linear(b + "attn.proj", h, h), **linear(b + "mlp.linear_fc1", i, h),
                           **linear(b + "mlp.linear_fc2", h, i)})
        shapes.update(merger("merger", h))  # normalises each patch before the merge, the DeepStack ones after
        for k in range(self.deepstack_layers):
            shapes.update(merger(f"deepstack_merger_list.{k}", m))
        return shapes


# Qwen3VLVisionConfig's defaults for the keys read here (tests/models/test_qwen3_vl.py checks them).
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                   "out_hidden_size": 3584, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                   "in_channels": 3, "num_position_embeddings": 2304, "deepstack_visual_indexes": (8, 16, 24)}


class Qwen3_VL(QwenVisionLanguage, Qwen3):
    model_type = "qwen3_vl"
    display_name = "Qwen3-VL"
    # Qwen3VLTextConfig's defaults and the top level's; its text config has no sliding-window keys.
    defaults = {**Family.defaults, "attention_bias": False, "head_dim": 128, "max_position_embeddings": 128000,
                "rope_theta": 500000.0, "image_token_id": 151655, "vision_start_token_id": 151652}
    vision_defaults = VISION_DEFAULTS
    default_mrope_section = (24, 20, 20)  # Qwen3VLTextRotaryEmbedding's when the config names none
    mrope_interleaved = True  # transformers' Qwen3-VL interleaves whatever config.json's mrope_interleaved says
    hf_language_prefix = "model.language_model."
    hf_vision_prefix = "model.visual."
    vision_tower_class = Qwen3VisionTower

    def sliding_window(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def vision_fields(self, vision: Mapping[str, Any], positive, source: Path) -> dict[str, Any]:
        depth, indexes = positive("depth"), vision["deepstack_visual_indexes"]
        if not isinstance(indexes, (list, tuple)) or not all(isinstance(i, int) and 0 <= i < depth for i in indexes):
            raise ArchitectureError(f"{source}: vision_config.deepstack_visual_indexes must list tower blocks "
                                    f"(0..{depth - 1}), got {indexes!r}")
        return dict(num_position_embeddings=positive("num_position_embeddings"),
                    deepstack_visual_indexes=tuple(indexes))

    def build_vision_tower(self, hf: Mapping[str, Any], dtype):
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**(hf.get("vision_config") or {})), dtype=dtype)


FAMILY = Qwen3_VL()
