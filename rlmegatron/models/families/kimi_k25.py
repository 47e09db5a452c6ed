"""Kimi-K2.5 (transformers' Kimi_K25ForConditionalGeneration): a DeepSeek-V3 language model (MLA, 384 routed experts
behind DeepSeek's grouped sigmoid router) in a vision-language wrapper with a MoonViT image encoder and a projector.

The language model is bridged as DeepSeek-V3 is. The image encoder is not: MoonViT (2-D rotary patches, its own patch
merger) is not the Qwen ViT the vision-language path builds, so a Kimi-K2.5 trains on text, and its vision tower and
projector are carried through conversion and every export unchanged (Family.carried_prefixes, models.carried), never
dropped. config.json keeps the language model's keys in text_config (model_type deepseek_v3, or kimi_k2 as Moonshot
writes it); the checkpoint keeps its tensors under language_model.model. and language_model.lm_head., as released
(transformers 5.24's own save_pretrained writes the language model's layers as `blocks`, which its loading does
not read back; such a save is refused with the keys no rule maps).
"""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import Family
from rlmegatron.models.families.deepseek_v3 import DeepseekV3

# What transformers' Kimi_K25Config sets at its top level, over the DeepSeek-V3 text_config's own defaults.
_WRAPPER_DEFAULTS = {"tie_word_embeddings": True}


class KimiK25(DeepseekV3):
    model_type = "kimi_k25"
    display_name = "Kimi-K2.5"
    defaults = {**DeepseekV3.defaults, **_WRAPPER_DEFAULTS}
    hf_language_prefix = "language_model.model."
    hf_lm_head = "language_model.lm_head.weight"
    reads_text_config = True
    carried_prefixes = ("vision_tower.", "mm_projector.", "model.mm_projector.")

    def config(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The language model's keys lifted out of text_config; whether the head is tied is the wrapper's (its
        top-level tie_word_embeddings, which transformers' ConditionalGeneration model follows)."""
        text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else {}
        lifted = {**{k: v for k, v in text.items() if k != "model_type"},
                  "tie_word_embeddings": hf.get("tie_word_embeddings", _WRAPPER_DEFAULTS["tie_word_embeddings"]),
                  "model_type": self.model_type, "text_model_type": text.get("model_type", "deepseek_v3")}
        return Family.config(self, lifted)

    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        problems = super().problems(cfg)
        if cfg["text_model_type"] not in ("deepseek_v3", "kimi_k2"):
            problems.append(f"text_config.model_type={cfg['text_model_type']!r} unsupported: Kimi-K2.5's language "
                            "model is bridged as DeepSeek-V3 (deepseek_v3 or kimi_k2)")
        return problems


FAMILY = KimiK25()
