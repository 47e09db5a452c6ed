"""Megatron layer specs: Transformer Engine when importable, else the local spec with CPU-capable modules."""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from rlmegatron.models.all_heads_norm import KEY, QUERY, AllHeadsRMSNorm
from rlmegatron.models.layers import (DuplicatedLinear, SDPACoreAttention, SequenceParallelTorchNorm, enable_local_mla,
                                      enable_packed_rope)

# Local-spec modules that cannot run our layouts, and their replacements:
# DotProductAttention rejects MLA's separate k/v head dims and packed sequences;
# WrappedTorchNorm asserts against sequence parallelism (needed for MoE with TP>1).
_LOCAL_CLASS_SUBSTITUTES = {DotProductAttention: SDPACoreAttention, WrappedTorchNorm: SequenceParallelTorchNorm}
# MLA's down projections are replicated across TP, as TE's spec has them (see DuplicatedLinear).
_LOCAL_FIELD_SUBSTITUTES = {"linear_q_down_proj": DuplicatedLinear, "linear_kv_down_proj": DuplicatedLinear}


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def decoder_block_spec(config, use_te: Optional[bool] = None, vp_stage: Optional[int] = None, family=None):
    """Block spec for the layers this pipeline stage builds (MoE/dense pattern from `config.moe_layer_freq`), with
    the modules of `family` (a models.families.Family) where its layers differ from Megatron's."""
    use_te = transformer_engine_available() if use_te is None else use_te
    spec = _megatron_decoder_block_spec(config, use_te, vp_stage)
    spec = _family_modules(spec if use_te else _local(spec, config), family)
    return _linear_attention_layers(spec, config, vp_stage) if config.linear_attention_freq else spec


def mtp_block_spec(config, use_te: Optional[bool] = None, vp_stage: Optional[int] = None, family=None):
    """Spec of the multi-token-prediction layers this stage builds (all on the last one), or None.

    Megatron builds each MTP layer's transformer layer from the last decoder layer's spec.
    """
    if not config.mtp_num_layers:
        return None
    use_te = transformer_engine_available() if use_te is None else use_te
    decoder = _megatron_decoder_block_spec(config, use_te, vp_stage)
    spec = get_gpt_mtp_block_spec(config, decoder, use_transformer_engine=use_te, vp_stage=vp_stage)
    return spec if spec is None else _family_modules(spec if use_te else _local(spec, config), family)


def _family_modules(spec, family):
    """`spec` with the modules a family needs in place of Megatron's: query/key norms over all heads together,
    DeepSeek Sparse Attention's core attention."""
    replacements = {}
    if family is not None and family.qk_norm_over_all_heads:
        replacements.update(q_layernorm=ModuleSpec(module=AllHeadsRMSNorm, params={"heads": QUERY}),
                            k_layernorm=ModuleSpec(module=AllHeadsRMSNorm, params={"heads": KEY}))
    if family is not None and family.sparse_attention:
        from rlmegatron.models.sparse_attention import SparseSDPACoreAttention  # lazy: a module of the one family

        replacements.update(core_attention=SparseSDPACoreAttention)
    return _with_fields(spec, replacements) if replacements else spec


def _linear_attention_layers(spec, config, vp_stage: Optional[int]):
    """`spec` with Gated DeltaNet (models.gated_delta_net) as the mixer of the layers config.linear_attention_freq
    marks (a list, 1 = linear attention), each with a norm of its own before it (a Transformer Engine attention fuses
    its norm into linear_qkv, which the Gated DeltaNet layer has not)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from rlmegatron.models.gated_delta_net import GatedDeltaNet  # lazy: a module of the hybrid families only

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = []
    for i, layer in enumerate(spec.layer_specs):
        if config.linear_attention_freq[offset + i]:
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(
                layer.submodules, self_attention=ModuleSpec(module=GatedDeltaNet),
                input_layernorm=SequenceParallelTorchNorm))
        layers.append(layer)
    return dataclasses.replace(spec, layer_specs=layers)


def _megatron_decoder_block_spec(config, use_te: bool, vp_stage: Optional[int]):
    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization, vp_stage=vp_stage
    )


def _local(spec, config):
    """The local spec with the modules that run our layouts, and Megatron's MLA ready to take them."""
    if config.multi_latent_attention:
        enable_local_mla()
    enable_packed_rope()
    return _substitute(spec)


def _substitute(node: Any, field: str = "") -> Any:
    """Copy of a local spec tree with the CPU-capable modules swapped in; the input is left untouched."""
    if isinstance(node, type):
        return _LOCAL_FIELD_SUBSTITUTES.get(field) or _LOCAL_CLASS_SUBSTITUTES.get(node, node)
    if isinstance(node, list):
        return [_substitute(item, field) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {f.name: _substitute(getattr(node, f.name), f.name) for f in dataclasses.fields(node)}
        if "module" in changes and field:  # a ModuleSpec: its class belongs to the field that holds it
            changes["module"] = _substitute(node.module, field)
        return dataclasses.replace(node, **changes)
    return node


def _with_fields(node: Any, replacements: dict[str, Any], field: str = "") -> Any:
    """Copy of a spec tree whose submodules in the fields named in `replacements` (where set) are those given."""
    if field in replacements and node is not None:
        return replacements[field]
    if isinstance(node, list):
        return [_with_fields(item, replacements) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: _with_fields(getattr(node, f.name), replacements, f.name)
                                            for f in dataclasses.fields(node)})
    return node
