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
    """The parameters Megatron trains (MTP layers excluded: RL does not train them)."""

    embedding: int
    output_layer: int  # 0 when tied to the embedding
    final_norm: int
    layers: tuple[LayerParameters, ...]

    @property
    def total(self) -> int:
        return self.embedding + self.output_layer + self.final_norm + sum(layer.total for layer in self.layers)

    @property
    def active(self) -> int:
        """Parameters one token uses: the published 'activated' count of MoE models."""
        return self.embedding + self.output_layer + self.final_norm + sum(layer.active for layer in self.layers)

    @property
    def routed_experts(self) -> int:
        return sum(layer.routed_experts for layer in self.layers)

    def in_checkpoint(self, tied: bool) -> int:
        """Tensors an HF safetensors checkpoint stores: some tied models (Qwen3-1.7B) still save lm_head."""
        return self.total + (self.embedding if tied else 0)


def count_parameters(arch: ModelArchitecture) -> ParameterCount:
    h = arch.hidden_size
    attention = _attention_parameters(arch)
    norms = 2 * h
    layers = []
    for index in range(arch.num_hidden_layers):
        if arch.moe_layers[index]:
            expert = _GATED_MLP_MATRICES * h * (arch.moe_intermediate_size or 0)
            router = arch.num_experts * h + (arch.num_experts if arch.router_bias else 0)
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
    )


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
        return query + key_value + heads * mla.v_head_dim * h
    d, kv_heads = arch.head_dim, arch.num_key_value_heads
    projections = h * heads * d + 2 * h * kv_heads * d + heads * d * h
    bias = (heads + 2 * kv_heads) * d if arch.qkv_bias else 0
    qk_norm = 2 * d if arch.qk_norm else 0
    return projections + bias + qk_norm
