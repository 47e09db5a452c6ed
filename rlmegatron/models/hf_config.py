"""HF config.json -> Megatron TransformerConfig / MLATransformerConfig and the GPTModel built from it.

What differs between models is their family's (models.families); this module builds what every family shares.
Megatron is imported inside the functions that build with it: model facts also serve `rlm validate` and the
converter's checks, which should not wait for Megatron's import.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from rlmegatron.models.families import (
    ArchitectureError,
    Family,
    ModelArchitecture,
    UnsupportedModelError,
    bridged_family,
    mtp_layers_in,
    read_config_json,
)
from rlmegatron.models.families.base import llama3_rope_scaling
from rlmegatron.models.pipeline import FIRST_STAGE, LAST_STAGE
from rlmegatron.runtime.distributed import ParallelLayout

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelFacts:
    """What GPTModel needs beyond TransformerConfig, and what the weight map needs to know."""

    hf: dict  # the (text) config.json as read, less a quantization_config: Megatron holds dequantised weights
    family: Family
    arch: ModelArchitecture
    padded_vocab_size: int
    tie_word_embeddings: bool
    rotary_base: float
    rotary_percent: float  # the share of each head's dimensions rotary embedding rotates
    llama3_rope_scaling: Optional[dict]  # Llama-3 rope scaling's four fields; None: no such scaling
    num_mtp_layers: int  # multi-token-prediction layers built, stored in HF after the decoder layers

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.arch.max_position_embeddings or 4096

    @property
    def num_layers(self) -> int:
        return self.arch.num_hidden_layers

    def vision_tower_factory(self, dtype):
        """What builds the image encoder (a vision-language model's, on the first pipeline stage) in `dtype`."""
        return lambda: self.family.build_vision_tower(self.hf, dtype)

    @property
    def mtp_off_note(self) -> Optional[str]:
        """What to tell the user when config.json declares MTP layers the checkpoint does not hold."""
        declared = self.arch.num_mtp_layers
        if declared <= self.num_mtp_layers:
            return None
        return (f"config.json declares num_nextn_predict_layers={declared} but the checkpoint holds no multi-token-"
                f"prediction tensors (model.layers.{self.num_layers}.*), as transformers saves "
                f"{self.family.display_name}: MTP is off")


def read_hf_config(path: str | Path) -> dict:
    """The config.json in `path` (a directory or the file), with a multimodal text_config unwrapped."""
    config_file = Path(path)
    if config_file.is_dir():
        config_file = config_file / "config.json"
    if not config_file.is_file():
        raise UnsupportedModelError(f"{path} is not a Hugging Face model directory: no config.json in it")
    try:
        return read_config_json(config_file)[0]
    except ArchitectureError as err:
        raise UnsupportedModelError(str(err)) from err


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocab rounded up so each TP rank holds an equal, MAKE_VOCAB_SIZE_DIVISIBLE_BY-aligned share."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


def model_facts(hf: dict, tp: int, padded_vocab: Optional[int] = None, mtp_layers: Optional[int] = None,
                keys: Optional[Collection[str]] = None) -> ModelFacts:
    """Facts of the model `hf` describes: as many MTP layers as `mtp_layers`, else as a checkpoint with tensor names
    `keys` holds, else as config.json declares. UnsupportedModelError names every value the bridge cannot express."""
    family = bridged_family(hf)
    try:
        arch = family.architecture(hf)
    except ArchitectureError as err:
        raise UnsupportedModelError(str(err)) from None
    padded = padded_vocab or padded_vocab_size(arch.vocab_size, tp)
    if padded % tp:
        raise UnsupportedModelError(f"padded vocab size {padded} (fixed by the checkpoint) is not divisible by TP={tp}")
    family.check(hf)
    cfg = family.config(hf)
    rope = family.rope(cfg)
    if mtp_layers is None:
        mtp_layers = arch.num_mtp_layers if keys is None else mtp_layers_in(arch, keys)
    return ModelFacts(
        # What the model exports describes its weights as Megatron holds them; an FP8 export adds its own.
        hf={key: value for key, value in hf.items() if key != "quantization_config"},
        family=family,
        arch=arch,
        padded_vocab_size=padded,
        tie_word_embeddings=arch.tie_word_embeddings,
        rotary_base=rope.theta,
        rotary_percent=rope.percent,
        llama3_rope_scaling=llama3_rope_scaling(cfg, rope) if rope.kind == "llama3" else None,
        num_mtp_layers=mtp_layers,
    )


def transformer_config(facts: ModelFacts, layout: ParallelLayout, dtype: str = "fp32", use_te: bool = False,
                       perform_initialization: bool = True, options: Optional[Mapping[str, Any]] = None):
    """Megatron TransformerConfig (MLATransformerConfig for a family with MLA) for `facts` at `layout`; `options`
    (spec_config_options) go on top of the fields rlmegatron sets."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    family, arch = facts.family, facts.arch
    cfg = family.config(facts.hf)
    params_dtype = DTYPES[dtype]
    common = dict(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu_initialization=True,
        perform_initialization=perform_initialization,
        mtp_num_layers=facts.num_mtp_layers or None,
        **layout.transformer_config_fields(),
    )
    if arch.is_moe:
        if arch.num_experts % layout.ep:
            raise UnsupportedModelError(f"{arch.num_experts} experts cannot be split over EP={layout.ep} ranks "
                                        "(num_experts % ep != 0)")
        common.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.num_experts_per_tok,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_layer_freq=[int(moe) for moe in arch.moe_layers],
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=use_te,
            moe_aux_loss_coeff=0.0,  # RL losses carry no router balancing term; logits do not depend on it
            moe_router_dtype="fp32",  # HF routers compute their logits in fp32
        )
        if layout.tp > 1 and not layout.sequence_parallel:
            raise UnsupportedModelError("MoE with TP>1 needs sequence_parallel=True in Megatron")
    config_class = MLATransformerConfig if family.multi_latent_attention else TransformerConfig
    config = config_class(**{**family.megatron_fields(arch, cfg), **common, **family.mlp_fields(cfg),
                             **(options or {})})
    for name, value in family.config_attributes(cfg).items():
        setattr(config, name, value)
    return config


def spec_config_options(megatron) -> dict[str, Any]:
    """TransformerConfig fields a spec's `megatron` section sets beyond its parallel layout: activation recompute,
    and `extra` verbatim but for the pipeline split, which the layout carries (config.checks vets the keys)."""
    options = {key: value for key, value in megatron.extra.items() if key not in (FIRST_STAGE, LAST_STAGE)}
    if megatron.recompute_granularity != "none":
        options["recompute_granularity"] = megatron.recompute_granularity
    if megatron.recompute_granularity == "full":
        options.update(recompute_method=megatron.recompute_method, recompute_num_layers=megatron.recompute_num_layers)
    return options


def build_gpt_model(facts: ModelFacts, config, use_te: bool = False, vp_stage: Optional[int] = None):
    """This rank's GPTModel chunk (pre/post process from the current pipeline stage; MTP layers on the last)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from rlmegatron.models.mtp import GPTModelWithMTP
    from rlmegatron.models.spec import decoder_block_spec, mtp_block_spec

    model_class = GPTModelWithMTP if config.mtp_num_layers else GPTModel
    vision = {}
    if facts.arch.vision is not None:
        from rlmegatron.models.vision import VisionLanguageModel

        model_class = VisionLanguageModel
        vision = dict(vision_tower=facts.vision_tower_factory(config.params_dtype),
                      image_token_id=facts.arch.vision.image_token_id,
                      deepstack_layers=facts.arch.vision.deepstack_layers,
                      mrope_interleaved=facts.family.mrope_interleaved)
    model = model_class(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, use_te=use_te, vp_stage=vp_stage, family=facts.family),
        mtp_block_spec=mtp_block_spec(config, use_te=use_te, vp_stage=vp_stage, family=facts.family),
        vocab_size=facts.padded_vocab_size,
        max_sequence_length=facts.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=facts.tie_word_embeddings,
        position_embedding_type=facts.family.position_embedding_type,
        rotary_percent=facts.rotary_percent,
        rotary_base=int(facts.rotary_base),
        vp_stage=vp_stage,
        **vision,
    )
    if facts.llama3_rope_scaling:
        _scale_llama3_rope(model.rotary_pos_emb, facts.llama3_rope_scaling)
    return model


def _scale_llama3_rope(rotary_pos_emb, scaling: dict) -> None:
    """Llama-3 scaling of the rotary frequencies with all four of the checkpoint's fields. Megatron-Core's
    RotaryEmbedding (0.16 and 0.19 alike) hands its `_apply_scaling` only the factor, fixing the other three to
    Llama-3.1's values, which Llama-3.2 and many fine-tunes do not use; `_apply_scaling` itself takes all four."""
    rotary_pos_emb.inv_freq = rotary_pos_emb._apply_scaling(rotary_pos_emb.inv_freq, **scaling)
