"""HF config.json -> Megatron TransformerConfig / MLATransformerConfig and the GPTModel built from it."""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from rlmegatron.config.architecture import ArchitectureError, _architecture_from
from rlmegatron.models.pipeline import FIRST_STAGE, LAST_STAGE
from rlmegatron.errors import UserError
from rlmegatron.runtime.distributed import ParallelLayout

# model_type -> family whose weight map and config rules apply.
FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "deepseek_v3": "deepseek_v3",
}
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UnsupportedModelError(UserError, ValueError):
    """The HF config names an architecture, or a value, that the bridge cannot express in Megatron."""


@dataclass(frozen=True)
class ModelFacts:
    """What GPTModel needs beyond TransformerConfig, and what the weight map needs to know."""

    hf: dict  # the (text) config.json as read
    family: str
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    rotary_base: float
    llama3_rope_scaling: Optional[dict]  # Llama-3 rope scaling's four fields; None: no such scaling
    num_mtp_layers: int  # DeepSeek's multi-token-prediction layers, stored in HF after the decoder layers

    @property
    def num_layers(self) -> int:
        return self.hf["num_hidden_layers"]

    @property
    def mtp_off_note(self) -> Optional[str]:
        """What to tell the user when config.json declares MTP layers the checkpoint does not hold."""
        declared = self.hf.get("num_nextn_predict_layers") or 0
        if declared <= self.num_mtp_layers:
            return None
        return (f"config.json declares num_nextn_predict_layers={declared} but the checkpoint holds no multi-token-"
                f"prediction tensors (model.layers.{self.num_layers}.*), as transformers saves DeepSeek-V3: MTP is off")


def read_hf_config(path: str | Path) -> dict:
    """The config.json in `path` (a directory or the file), with a multimodal text_config unwrapped."""
    config_file = Path(path)
    if config_file.is_dir():
        config_file = config_file / "config.json"
    if not config_file.is_file():
        raise UnsupportedModelError(f"{path} is not a Hugging Face model directory: no config.json in it")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnsupportedModelError(f"{config_file}: not a JSON config ({err})") from err
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{config_file}: not a JSON object")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    return config


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocab rounded up so each TP rank holds an equal, MAKE_VOCAB_SIZE_DIVISIBLE_BY-aligned share."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


def _rope(hf: dict) -> tuple[float, dict]:
    """(rope_theta, rope scaling dict); transformers 5 moved both into rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params.update(scaling)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), params


def mtp_layers_in(hf: dict, keys: Collection[str]) -> int:
    """DeepSeek's MTP layers a checkpoint with these tensor names holds: the declared ones, or none when the first
    is absent (a DeepSeek-V3 saved by transformers, which does not implement MTP, says 1 and has none)."""
    declared = hf.get("num_nextn_predict_layers") or 0
    first = f"model.layers.{hf['num_hidden_layers']}."
    return declared if declared and any(key.startswith(first) for key in keys) else 0


def model_facts(hf: dict, tp: int, padded_vocab: Optional[int] = None, mtp_layers: Optional[int] = None) -> ModelFacts:
    """Facts of the model `hf` describes; `mtp_layers` is how many MTP layers to build (None: as config.json says)."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    try:
        arch = _architecture_from(hf, Path("config.json"))
    except ArchitectureError as err:
        raise UnsupportedModelError(str(err)) from None
    padded = padded_vocab or padded_vocab_size(arch.vocab_size, tp)
    if padded % tp:
        raise UnsupportedModelError(f"padded vocab size {padded} (fixed by the checkpoint) is not divisible by TP={tp}")
    theta, rope = _rope(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # MLA's rotary embedding is DeepSeek's own (yarn); every other family uses GPTModel's (llama3 scaling).
    if rope_type not in (("default", "yarn") if model_type == "deepseek_v3" else ("default", "llama3")):
        raise UnsupportedModelError(f"rope_scaling.rope_type={rope_type!r} unsupported for {model_type}")
    llama3_rope = _llama3_rope_scaling(hf, rope) if rope_type == "llama3" else None
    return ModelFacts(
        hf=hf,
        family=FAMILIES[model_type],
        vocab_size=arch.vocab_size,
        padded_vocab_size=padded,
        tie_word_embeddings=arch.tie_word_embeddings,
        max_position_embeddings=arch.max_position_embeddings or 4096,
        rotary_base=theta,
        llama3_rope_scaling=llama3_rope,
        num_mtp_layers=arch.num_mtp_layers if mtp_layers is None else mtp_layers,
    )


def _llama3_rope_scaling(hf: dict, rope: dict) -> dict:
    """The four fields of Llama-3 rope scaling as transformers reads them: it requires the three factors and takes
    original_max_position_embeddings from the config's top level, else the rope dict, else max_position_embeddings."""
    missing = [field for field in ("factor", "low_freq_factor", "high_freq_factor") if rope.get(field) is None]
    if missing:
        raise UnsupportedModelError(f"rope_scaling (rope_type llama3) lacks {' and '.join(missing)}; "
                                    "transformers requires factor, low_freq_factor and high_freq_factor")
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
        or hf.get("max_position_embeddings")
    if original is None:
        raise UnsupportedModelError("rope_scaling (rope_type llama3) lacks original_max_position_embeddings, "
                                    "and config.json has no max_position_embeddings to fall back on")
    return dict(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]), original_max_position_embeddings=original)


def _reject(hf: dict, field: str, allowed: Any, why: str) -> None:
    value = hf.get(field)
    if value not in allowed:
        raise UnsupportedModelError(f"{field}={value!r} unsupported: {why}")


def _moe_layer_freq(hf: dict) -> list[int]:
    """1 for each MoE layer, 0 for each dense one, from whichever fields this family uses."""
    layers = hf["num_hidden_layers"]
    if hf["model_type"] == "deepseek_v3":
        k = hf.get("first_k_dense_replace", 0)
        return [0 if i < k or i % hf.get("moe_layer_freq", 1) else 1 for i in range(layers)]
    if hf["model_type"] == "mixtral":
        return [1] * layers
    step = hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [0 if i in dense or (i + 1) % step else 1 for i in range(layers)]


def transformer_config(facts: ModelFacts, layout: ParallelLayout, dtype: str = "fp32", use_te: bool = False,
                       perform_initialization: bool = True, options: Optional[Mapping[str, Any]] = None):
    """Megatron TransformerConfig (MLATransformerConfig for DeepSeek-V3) for `facts` at `layout`; `options`
    (spec_config_options) go on top of the fields rlmegatron sets."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    hf, family = facts.hf, facts.family
    _reject(hf, "hidden_act", ("silu",), "only SwiGLU MLPs are bridged")
    _reject(hf, "mlp_bias", (None, False), "Megatron's MLP here has no bias")
    if hf.get("use_sliding_window") or (family == "mixtral" and hf.get("sliding_window")):
        raise UnsupportedModelError("sliding_window attention is unsupported (use_sliding_window / sliding_window)")
    params_dtype = DTYPES[dtype]
    heads = hf["num_attention_heads"]
    common = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
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
        **layout.transformer_config_fields(),
    )
    experts = next((hf[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if hf.get(k)), 0)
    if experts:
        if experts % layout.ep:
            raise UnsupportedModelError(f"{experts} experts cannot be split over EP={layout.ep} ranks (num_experts % ep != 0)")
        common.update(
            num_moe_experts=experts,
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
            moe_layer_freq=_moe_layer_freq(hf),
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=use_te,
            moe_aux_loss_coeff=0.0,  # RL losses carry no router balancing term; logits do not depend on it
            moe_router_dtype="fp32",  # HF routers compute their logits in fp32
        )
        if layout.tp > 1 and not layout.sequence_parallel:
            raise UnsupportedModelError("MoE with TP>1 needs sequence_parallel=True in Megatron")
    if family in ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"):
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        config = dict(
            num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=head_dim,
            add_qkv_bias=family in ("qwen2", "qwen2_moe") or bool(hf.get("attention_bias")),
            qk_layernorm=family in ("qwen3", "qwen3_moe"),
        )
        if family in ("qwen2_moe", "qwen3_moe"):
            # norm_topk_prob: softmax over the top-k (Megatron's default); else softmax over all, then top-k.
            config["moe_router_pre_softmax"] = not hf.get("norm_topk_prob", False)
        if family == "qwen2_moe" and hf.get("shared_expert_intermediate_size"):
            config.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"], moe_shared_expert_gate=True)
        return TransformerConfig(**{**config, **common, **(options or {})})
    # DeepSeek-V3: MLA, sigmoid router with expert bias and group-limited routing, shared experts.
    _reject(hf, "scoring_func", (None, "sigmoid"), "Megatron's DeepSeek router here is sigmoid")
    _reject(hf, "topk_method", (None, "noaux_tc"), "only the aux-loss-free (expert bias) router is bridged")
    _reject(hf, "norm_topk_prob", (None, True), "Megatron always renormalises sigmoid top-k scores")
    _reject(hf, "rope_interleave", (None, True), "Megatron's MLA rope is the interleaved one")
    _, rope = _rope(hf)
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    config = dict(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        qk_layernorm=True,
        rotary_base=facts.rotary_base,
        rope_type="yarn" if yarn else "rope",
        rotary_scaling_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
        original_max_position_embeddings=rope.get("original_max_position_embeddings", facts.max_position_embeddings),
        beta_fast=float(rope.get("beta_fast", 32)),
        beta_slow=float(rope.get("beta_slow", 1)),
        mscale=float(rope.get("mscale", 1.0)) if yarn else 1.0,
        mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)) if yarn else 0.0,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=hf.get("n_group"),
        moe_router_group_topk=hf.get("topk_group"),
        moe_router_topk_scaling_factor=hf.get("routed_scaling_factor"),
        moe_shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"] or None,
        mtp_num_layers=facts.num_mtp_layers or None,
    )
    return MLATransformerConfig(**{**config, **common, **(options or {})})


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
    model = model_class(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, use_te=use_te, vp_stage=vp_stage),
        mtp_block_spec=mtp_block_spec(config, use_te=use_te, vp_stage=vp_stage),
        vocab_size=facts.padded_vocab_size,
        max_sequence_length=facts.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=facts.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(facts.rotary_base),
        vp_stage=vp_stage,
    )
    if facts.llama3_rope_scaling:
        _scale_llama3_rope(model.rotary_pos_emb, facts.llama3_rope_scaling)
    return model


def _scale_llama3_rope(rotary_pos_emb, scaling: dict) -> None:
    """Llama-3 scaling of the rotary frequencies with all four of the checkpoint's fields. Megatron-Core's
    RotaryEmbedding (0.16 and 0.19 alike) hands its `_apply_scaling` only the factor, fixing the other three to
    Llama-3.1's values, which Llama-3.2 and many fine-tunes do not use; `_apply_scaling` itself takes all four."""
    rotary_pos_emb.inv_freq = rotary_pos_emb._apply_scaling(rotary_pos_emb.inv_freq, **scaling)
