"""Qwen3.5-MoE (transformers' Qwen3_5MoeForConditionalGeneration): Qwen3-Next's hybrid decoder (qwen3_next.py) in a
vision-language wrapper. It differs from Qwen3-Next only in names: config.json keeps the language model's keys in
text_config, the checkpoint its tensors under model.language_model., Gated DeltaNet's input projections are unfused
(in_proj_qkv [q; k; v], in_proj_z, in_proj_b, in_proj_a), and every layer's MLP is routed, the top-k weights always
renormalised.

The vision tower (model.visual.) is Qwen3-VL's with learned position embeddings, which the vision-language path here
does not build: a Qwen3.5-MoE trains on text, and its tower is carried through conversion and every export unchanged
(models.carried), as is the MTP layer (mtp.). Text positions in its multimodal rotary embedding are the plain ones.
"""
from __future__ import annotations

from typing import Any, Mapping

from rlmegatron.models.families.base import Family, LinearAttention, Rows, Source
from rlmegatron.models.families.qwen3_next import Qwen3Next

_WRAPPER_DEFAULTS = {"tie_word_embeddings": False}  # transformers' Qwen3_5MoeConfig's, over its text_config


class Qwen3_5Moe(Qwen3Next):
    model_type = "qwen3_5_moe"
    display_name = "Qwen3.5-MoE"
    # transformers' Qwen3_5MoeTextConfig has no routing switches: every layer routed, the top-k always renormalised
    defaults = {**{k: v for k, v in Qwen3Next.defaults.items()
                   if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}, "vocab_size": 248320}
    hf_language_prefix = "model.language_model."
    hf_vision_prefix = "model.visual."  # as transformers 5 nests it, in the checkpoint as in memory
    reads_text_config = True
    carried_prefixes = ("model.visual.", "mtp.")

    def config(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The language model's keys lifted out of text_config (a text-only config.json, as Qwen3_5MoeForCausalLM
        saves, is read as it is); whether the head is tied is the wrapper's."""
        text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else None
        if text is None:
            return super().config(hf)
        lifted = {**{k: v for k, v in text.items() if k != "model_type"},
                  "tie_word_embeddings": hf.get("tie_word_embeddings", _WRAPPER_DEFAULTS["tie_word_embeddings"]),
                  "model_type": self.model_type}
        return Family.config(self, lifted)

    def router_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return {"moe_router_pre_softmax": False}  # softmax over the top-k: renormalised whatever config.json says

    def projection_sources(self, h: str, linear: LinearAttention) -> list[Source]:
        keys, values = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim
        heads = linear.num_value_heads
        qkv = [Source(h + "in_proj_qkv.weight", rows=Rows(1, 2 * keys + values, start, rows))
               for start, rows in ((0, keys), (keys, keys), (2 * keys, values))]
        return qkv + [Source(h + f"in_proj_{name}.weight", rows=Rows(1, size, 0, size))
                      for name, size in (("z", values), ("b", heads), ("a", heads))]


FAMILY = Qwen3_5Moe()
