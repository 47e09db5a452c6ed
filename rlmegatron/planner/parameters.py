"""Exact parameter counts of a decoder from its architecture: per layer, split into what TP and what EP shards."""
from __future__ import annotations

from dataclasses import dataclass

from rlmegatron.models.families import ModelArchitecture

# Every model the readers know uses a gated MLP (SiLU(gate) * up, then down): three matrices.
_GATED_MLP_MATRICES = 3


@dataclass(frozen=True)
class LayerParameters:
    """One transformer layer: `dense` is sharded by tensor parallelism, `routed_experts` by EP × ETP."""

    attention: int  # projections, biases and q/k norms
    mlp: int  # a dense layer's MLP, or a MoE layer's shared experts, their gate and the router
    norms: int  # the two layer norms around attention and MLP
    routed_experts: int  # every routed expert of the layer; 0 in dense layers
    active_routed_experts: int  # the experts one token passes through

    @property
    def dense(self) -> int:
        return self.attention + self.mlp + self.norms

    @property
    def total(self) -> int:
        return self.dense + self.routed_experts

    @property
    def active(self) -> int:
        return self.dense + self.active_routed_experts


@dataclass(frozen=True)
class ParameterCount:
    """The parameters Megatron holds. `total` and `active` are the main model's (the published counts); the
    multi-token-prediction layers are counted apart (`mtp_total`): Megatron builds them on the last pipeline stage
    when the checkpoint holds them, and they train with actor.mtp.loss_weight."""

    embedding: int
    output_layer: int  # 0 when tied to the embedding
    final_norm: int
    layers: tuple[LayerParameters, ...]
    vision: int = 0  # a vision-language model's image encoder: whole on every rank of the first pipeline stage
    mtp: tuple[LayerParameters, ...] = ()  # each MTP layer's transformer layer (built like the last decoder layer)
    mtp_projections: int = 0  # the MTP layers' own: eh_proj [h, 2h], enorm, hnorm and the final norm, all layers

    @property
    def total(self) -> int:
        return self.embedding + self.output_layer + self.final_norm + self.vision + \
            sum(layer.total for layer in self.layers)

    @property
    def active(self) -> int:
        """Parameters one token uses: the published 'activated' count of MoE models."""
        return self.embedding + self.output_layer + self.final_norm + self.vision + \
            sum(layer.active for layer in self.layers)

    @property
    def routed_experts(self) -> int:
        return sum(layer.routed_experts for layer in self.layers)

    @property
    def mtp_dense(self) -> int:
        """The MTP layers' parameters tensor parallelism shards (their embedding and head are the main model's)."""
        return self.mtp_projections + sum(layer.dense for layer in self.mtp)

    @property
    def mtp_routed_experts(self) -> int:
        return sum(layer.routed_experts for layer in self.mtp)

    @property
    def mtp_total(self) -> int:
        return self.mtp_dense + self.mtp_routed_experts

    @property
    def mtp_active(self) -> int:
        """Parameters one token uses in the MTP layers, the shared output head of each included (its logits)."""
        head = self.output_layer or self.embedding
        return sum(self.mtp_projections // len(self.mtp) + layer.active + head for layer in self.mtp)

    def in_checkpoint(self, tied: bool) -> int:
        """Tensors an HF safetensors checkpoint stores: some tied models (Qwen3-1.7B) still save lm_head."""
        return self.total + (self.embedding if tied else 0)


def count_parameters(arch: ModelArchitecture, mtp_layers: int = 0) -> ParameterCount:
    """`mtp_layers`: the multi-token-prediction layers Megatron builds (models.families.built_mtp_layers)."""
    h = arch.hidden_size
    full_attention = _attention_parameters(arch)
    linear = arch.linear_attention  # a hybrid's Gated DeltaNet layers mix tokens with their own projections
    norms = 2 * h
    layers = []
    for index in range(arch.num_hidden_layers):
        attention = linear.parameters(h) if linear is not None and linear.layers[index] else full_attention
        if arch.moe_layers[index]:
            expert = _GATED_MLP_MATRICES * h * (arch.moe_intermediate_size or 0)
            if arch.biased_linears:  # gate/up and down biases
                expert += 2 * (arch.moe_intermediate_size or 0) + h
            router = arch.num_experts * h + (arch.num_experts if arch.router_bias or arch.biased_linears else 0)
            shared = _GATED_MLP_MATRICES * h * arch.shared_expert_intermediate_size
            shared += h if arch.shared_expert_gate else 0
            layers.append(
                LayerParameters(
                    attention=attention,
                    mlp=router + shared,
                    norms=norms,
                    routed_experts=arch.num_experts * expert,
                    active_routed_experts=(arch.num_experts_per_tok or 0) * expert,
                )
            )
        else:
            dense_mlp = _GATED_MLP_MATRICES * h * (arch.intermediate_size or 0)
            layers.append(LayerParameters(attention, dense_mlp, norms, 0, 0))
    embedding = arch.vocab_size * h
    return ParameterCount(
        embedding=embedding,
        output_layer=0 if arch.tie_word_embeddings else embedding,
        final_norm=h,
        layers=tuple(layers),
        vision=arch.vision.num_parameters if arch.vision is not None else 0,
        mtp=(layers[-1],) * mtp_layers,
        mtp_projections=mtp_layers * (2 * h * h + 3 * h),
    )


def checkpoint_tensors(arch: ModelArchitecture) -> int:
    """The tensors an HF checkpoint names for the language model, each routed expert's three projections apart (as
    transformers saves them and as SGLang's and vLLM's loaders take them, one by one): what a weight sync's receiver
    loads tensor by tensor. DeepSeek-V3: 45,395, the count NeMo-RL's refit benchmark gives per vLLM rank. The MTP
    layers are left out; a Gated DeltaNet layer or a sparse-attention indexer is counted as full attention and
    gpt-oss's stacked experts one by one (a few tensors per layer either way, beside the experts')."""
    if arch.mla is not None:  # q_a, its norm and q_b (or q alone), kv_a, its norm, kv_b, o
        attention = (3 if arch.mla.q_lora_rank else 1) + 4
    else:  # q, k, v, o and their biases, q/k norms, sinks
        attention = 4 + 3 * arch.qkv_bias + arch.biased_linears + 2 * arch.qk_norm + arch.attention_sinks
    expert = _GATED_MLP_MATRICES * (1 + arch.biased_linears)
    router = 1 + (arch.router_bias or arch.biased_linears)
    shared = _GATED_MLP_MATRICES * (arch.shared_expert_intermediate_size > 0) + arch.shared_expert_gate
    mlps = sum(arch.num_experts * expert + router + shared if moe else _GATED_MLP_MATRICES for moe in arch.moe_layers)
    return arch.num_hidden_layers * (2 + attention) + mlps + 2 + (not arch.tie_word_embeddings)


def _attention_parameters(arch: ModelArchitecture) -> int:
    h, heads = arch.hidden_size, arch.num_attention_heads
    mla = arch.mla
    if mla is not None:
        qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            query = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * qk_head
        else:
            query = h * heads * qk_head
        key_value = (
            h * (mla.kv_lora_rank + mla.qk_rope_head_dim)  # kv_a_proj_with_mqa
            + mla.kv_lora_rank  # kv_a_layernorm
            + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)  # kv_b_proj
        )
        index_heads, index_dim = arch.indexer  # wq_b, wk, its LayerNorm, weights_proj
        indexer = (mla.q_lora_rank or h) * index_heads * index_dim + h * index_dim + 2 * index_dim + h * index_heads \
            if index_heads else 0
        return query + key_value + heads * mla.v_head_dim * h + indexer
    d, kv_heads = arch.head_dim, arch.num_key_value_heads
    # An output gate is q_proj's second half: a gate per query channel.
    projections = h * heads * d * (2 if arch.attention_output_gate else 1) + 2 * h * kv_heads * d + heads * d * h
    bias = (heads + 2 * kv_heads) * d if arch.qkv_bias else 0
    bias += h if arch.biased_linears else 0  # o_proj's
    qk_norm = 0 if not arch.qk_norm else (heads + kv_heads) * d if arch.qk_norm_over_all_heads else 2 * d
    sinks = heads if arch.attention_sinks else 0
    return projections + bias + qk_norm + sinks


@dataclass(frozen=True)
class LoRALayerParameters:
    """One layer's LoRA factors (actor.lora), by how they split: on a column-parallel linear (linear_qkv,
    linear_fc1) A [r, in] is replicated over TP and B [out, r] split; on a row-parallel one (linear_proj,
    linear_fc2) A is split and B replicated. Routed experts' split over ETP, and each EP rank holds its experts'."""

    split: int
    replicated: int
    expert_split: int
    expert_replicated: int

    def dense_per_gpu(self, tp: int) -> int:
        return self.split // tp + self.replicated

    def experts_per_gpu(self, ep: int, etp: int) -> int:
        return (self.expert_split // etp + self.expert_replicated) // ep


def lora_parameters(arch: ModelArchitecture, rank: int, targets: tuple[str, ...]) -> tuple[LoRALayerParameters, ...]:
    """The LoRA factors of each decoder layer (rlmegatron.models.lora), for `rank` on the `targets` linears."""
    h = arch.hidden_size

    def factors(column: bool, fan_in: int, fan_out: int) -> tuple[int, int]:
        """(split, replicated) parameters of one adapted linear."""
        return (rank * fan_out, rank * fan_in) if column else (rank * fan_in, rank * fan_out)

    def mlp(ffn: int) -> list[tuple[int, int]]:  # gated: fc1 holds gate and up; ffn 0: no such MLP
        return [factors(True, h, 2 * ffn) if "linear_fc1" in targets and ffn else (0, 0),
                factors(False, ffn, h) if "linear_fc2" in targets and ffn else (0, 0)]

    attention = []
    if "linear_qkv" in targets and arch.mla is None:  # MLA's projections are other linears, which LoRA leaves
        attention.append(factors(True, h, (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim))
    if "linear_proj" in targets:
        value_dim = arch.mla.v_head_dim if arch.mla is not None else arch.head_dim
        attention.append(factors(False, arch.num_attention_heads * value_dim, h))
    layers = []
    for moe in arch.moe_layers:
        dense = attention + mlp(arch.shared_expert_intermediate_size if moe else arch.intermediate_size or 0)
        experts = mlp(arch.moe_intermediate_size or 0) if moe else []
        layers.append(LoRALayerParameters(sum(s for s, _ in dense), sum(r for _, r in dense),
                                          arch.num_experts * sum(s for s, _ in experts),
                                          arch.num_experts * sum(r for _, r in experts)))
    return tuple(layers)
