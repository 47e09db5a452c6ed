"""What the model families share: the architecture facts read from an HF config.json, and the base Family, which reads
a decoder the way Llama's transformers code is written (GQA attention, SwiGLU MLPs, rotary embeddings).

A family module (llama.py, qwen3.py, deepseek_v3.py, ...) subclasses Family where its transformers modeling code
differs. Pure Python: the spec checks read architectures through the families without importing torch; the
Megatron-Core config, layer spec and weight map are built from what a family says here (models.hf_config,
models.spec, models.weight_map).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from rlmegatron.errors import UserError

# The transforms a weight-map rule applies to its HF tensors (models.weight_map implements them). CONCAT: the
# sources' rows one after another, each split over TP (GLU is its case of two equal halves); every CONCAT source
# names its rows (Source.rows), so that the Megatron tensor splits back without knowing the checkpoint.
IDENTITY, QKV, GLU, VOCAB, CONCAT = "identity", "qkv", "glu", "vocab", "concat"


class ArchitectureError(UserError, ValueError):
    """The config.json is missing, is not JSON, or lacks a field every decoder has."""


class UnsupportedModelError(UserError, ValueError):
    """The HF config names an architecture, or a value, that the bridge cannot express in Megatron."""


@dataclass(frozen=True)
class MultiLatentAttention:
    """DeepSeek's MLA projection sizes; q_lora_rank is None when queries are projected directly."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class VisionTower:
    """A vision-language model's image encoder as its config.json's vision_config states it (Qwen2.5-VL's ViT:
    patches embedded by a 3-D convolution, pre-norm blocks with biased linears, a merger that folds each
    spatial_merge_size x spatial_merge_size square of patches into one language-model token)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's hidden size: one merged token is one decoder input
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    image_token_id: int  # the placeholder token each merged image token replaces in the decoder input
    vision_start_token_id: int

    @property
    def merged_hidden_size(self) -> int:
        return self.hidden_size * self.spatial_merge_size ** 2

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight of the tower, named as transformers names them under the tower's module, with its shape
        (the weight map and the planner read the tower from this, without building it)."""
        h, i, m = self.hidden_size, self.intermediate_size, self.merged_hidden_size
        shapes = {"patch_embed.proj.weight": (h, self.in_channels, self.temporal_patch_size, self.patch_size,
                                              self.patch_size)}
        for block in range(self.depth):
            b = f"blocks.{block}."
            shapes.update({b + "norm1.weight": (h,), b + "norm2.weight": (h,),
                           b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                           b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,)})
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                shapes.update({f"{b}mlp.{name}.weight": shape, f"{b}mlp.{name}.bias": shape[:1]})
        shapes.update({"merger.ln_q.weight": (h,), "merger.mlp.0.weight": (m, m), "merger.mlp.0.bias": (m,),
                       "merger.mlp.2.weight": (self.out_hidden_size, m), "merger.mlp.2.bias": (self.out_hidden_size,)})
        return shapes

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.parameter_shapes().values())

    @property
    def deepstack_layers(self) -> int:
        """Decoder layers (the first ones) after which the tower's DeepStack features are added to the image
        tokens' hidden states (Qwen3-VL's); 0: the merged embeddings enter the decoder input only."""
        return 0

    def image_tokens(self, height: int, width: int) -> int:
        """Decoder tokens of one image of height x width pixels (already resized to whole merged patches)."""
        unit = self.patch_size * self.spatial_merge_size
        return (height // unit) * (width // unit)


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet's sizes (Qwen3-Next's and Qwen3.5's linear-attention layers) and which layers have it."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[bool, ...]  # per decoder layer: Gated DeltaNet (True) or full attention

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def parameters(self, hidden: int) -> int:
        """Weights of one Gated DeltaNet mixer: q/k/v/z/b/a projections, the causal convolution, the decay's two
        per-head vectors, the gated output norm and the output projection."""
        value = self.num_value_heads * self.value_head_dim
        projected = self.conv_channels + value + 2 * self.num_value_heads
        return (hidden * projected + self.conv_channels * self.conv_kernel + 2 * self.num_value_heads
                + self.value_head_dim + value * hidden)


@dataclass(frozen=True)
class ModelArchitecture:
    """Shape of a decoder-only transformer as its HF config.json states it, read by its family."""

    source: Path
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int | None
    num_experts: int  # routed experts; 0 for a dense model
    moe_intermediate_size: int | None  # hidden size of one routed expert's MLP
    num_experts_per_tok: int | None
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    head_dim: int = 0  # per attention head; HF's default is hidden_size / num_attention_heads
    qkv_bias: bool = False
    qk_norm: bool = False
    moe_layers: tuple[bool, ...] = ()  # per decoder layer: its MLP is routed (DeepSeek's first_k_dense_replace stay dense)
    shared_expert_intermediate_size: int = 0  # all shared experts of a layer together; 0 when none
    shared_expert_gate: bool = False  # Qwen2-MoE scales its shared expert by a learned sigmoid gate
    router_bias: bool = False  # DeepSeek-V3's and GLM-4.5's e_score_correction_bias
    mla: MultiLatentAttention | None = None
    num_mtp_layers: int = 0  # multi-token-prediction layers config.json declares, stored after the decoder layers
    biased_linears: bool = False  # every linear has a bias: o_proj, the experts', the router's (gpt-oss)
    attention_sinks: bool = False  # a learned sink logit per attention head (gpt-oss)
    qk_norm_over_all_heads: bool = False  # the query/key norms span all heads of a token (MiniMax-M2)
    indexer: tuple[int, int] = (0, 0)  # DeepSeek Sparse Attention's lightning indexer: (heads, head size); (0, 0): none
    vision: VisionTower | None = None  # a vision-language model's image encoder; None for a text-only model
    attention_output_gate: bool = False  # q_proj also yields a per-channel sigmoid gate on the attention output
    linear_attention: LinearAttention | None = None  # Gated DeltaNet layers (Qwen3-Next, Qwen3.5); None: none

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


@dataclass(frozen=True)
class Rope:
    """The rotary embedding a config.json asks for: base, type and the type's fields (rope_parameters, or
    transformers 4's rope_scaling), and the share of each head it rotates."""

    theta: float
    kind: str
    params: Mapping[str, Any]
    percent: float = 1.0


@dataclass(frozen=True)
class Rows:
    """Rows of a tensor's dim 0 laid out as `groups` groups of `size` rows each: rows start..start+length-1 of every
    group, in group order (Qwen3-Next's in_proj_qkvz holds each key head's q, k, v and z rows together: its q rows
    are Rows(key heads, per-head size, 0, key head dim); a plain range is one group)."""

    groups: int
    size: int
    start: int
    length: int

    def select(self, tensor):
        return tensor.unflatten(0, (self.groups, self.size))[:, self.start:self.start + self.length].flatten(0, 1)

    def place(self, whole, part) -> None:
        """Write `part` (what select gives) into its rows of `whole`."""
        whole.unflatten(0, (self.groups, self.size))[:, self.start:self.start + self.length].copy_(
            part.unflatten(0, (self.groups, self.length)))


@dataclass(frozen=True)
class Source:
    """One HF tensor, or one expert's slab (and gate/up half) of a stacked HF expert tensor, or some of its rows."""

    key: str
    expert: Optional[int] = None  # index into a stacked [E, ...] tensor
    part: Optional[tuple[int, int]] = None  # (i, n): the i-th of n equal chunks of dim 0
    stride: Optional[tuple[int, int]] = None  # (i, n): elements i, i+n, ... of the last dim (gpt-oss's gate/up)
    transposed: bool = False  # the slab is stored [in, out] (gpt-oss's experts), Megatron's weight is [out, in]
    rows: Optional[Rows] = None  # only these rows of the tensor (a fused HF projection's part)

    @property
    def reads_whole_slab(self) -> bool:
        """A strided, transposed or row-grouped source is read whole and then selected (safetensors slices only
        ranges)."""
        return self.stride is not None or self.transposed or (self.rows is not None and self.rows.groups > 1)

    def select(self, slab):
        """This source's tensor out of its (expert's) slab (a torch tensor; a view of it, but for grouped rows)."""
        if self.rows is not None:
            slab = self.rows.select(slab)
        if self.part is not None:
            slab = slab.chunk(self.part[1], dim=0)[self.part[0]]
        if self.stride is not None:
            slab = slab[..., self.stride[0]::self.stride[1]]
        return slab.transpose(-2, -1) if self.transposed and slab.dim() > 1 else slab

    def slab_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape `select` gives of a slab of `shape`."""
        shape = list(shape)
        if self.rows is not None:
            shape[0] = self.rows.groups * self.rows.length
        if self.part is not None:
            shape[0] //= self.part[1]
        if self.stride is not None:
            shape[-1] = len(range(self.stride[0], shape[-1], self.stride[1]))
        if self.transposed and len(shape) > 1:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return tuple(shape)

    def whole_slab_shape(self, selected: Sequence[int]) -> tuple[int, ...]:
        """The inverse of slab_shape: the shape of the slab `select` turns into a tensor of shape `selected`."""
        shape = list(selected)
        if self.transposed and len(shape) > 1:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        if self.stride is not None:
            shape[-1] *= self.stride[1]
        if self.part is not None:
            shape[0] *= self.part[1]
        if self.rows is not None:
            shape[0] = self.rows.groups * self.rows.size
        return tuple(shape)


@dataclass(frozen=True)
class SameBucket:
    """HF tensors that an inference engine fuses while it loads them, so one weight update must carry them all:
    the names matching `pattern` that differ only in its `member` group, one of `members`."""

    pattern: str
    members: frozenset[str]


def whole_number(config: Mapping[str, Any], key: str) -> int | None:
    """config[key] when it is an integer (not a bool), else None."""
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Family:
    """How one model_type's config.json reads and what it becomes in Megatron-Core; subclasses override what their
    transformers modeling code does differently from Llama's."""

    model_type = ""
    display_name = ""  # the model's name in messages
    # transformers' defaults (its config class) for the keys this family reads, where a config.json without
    # them would otherwise be misread; tests/models/families check them against transformers.
    defaults: Mapping[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                                   "rope_theta": 10000.0}
    # transformers' other names of some keys (its config class's attribute_map): alias -> the key read here
    aliases: Mapping[str, str] = {}
    expert_count_key: Optional[str] = None  # the key holding the routed-expert count; None: a dense family
    rope_types: tuple[str, ...] = ("default", "llama3")
    position_embedding_type = "rope"  # GPTModel's; a vision-language family's is "mrope" (multimodal rotary)
    # M-RoPE's frequencies interleave time, height and width (Qwen3-VL) instead of a contiguous section each
    mrope_interleaved = False
    # Where the checkpoint keeps the language model's tensors (embed_tokens, layers, norm): transformers 5 saves
    # Qwen3-VL's nested under model.language_model., every other family's under model.
    hf_language_prefix = "model."
    hf_vision_prefix = "visual."  # and the vision tower's (a vision-language family's): Qwen2.5-VL's visual.
    hf_lm_head = "lm_head.weight"  # the output head's key (an untied one): Kimi-K2.5's is under language_model.
    # config.json keeps the language model's keys in text_config and the family reads the whole file (lifting them
    # out itself); otherwise read_config_json hands it text_config alone, where a multimodal wrapper has one.
    reads_text_config = False
    # Checkpoint tensors outside the language model that the bridge does not train and carries as they are, from the
    # checkpoint converted to every export of it (models.carried): Kimi-K2.5's vision tower and projector.
    carried_prefixes: tuple[str, ...] = ()
    multi_latent_attention = False  # MLA: MLATransformerConfig, and Megatron's MLA layer spec, instead of GQA
    # Query/key norms over all heads of a token together (MiniMax-M2's; models.all_heads_norm), not each head apart
    qk_norm_over_all_heads = False
    biased_linears = False  # every linear biased, experts and router included (gpt-oss: Megatron's add_bias_linear)
    attention_sinks = False  # a learned sink per attention head (gpt-oss: softmax_type "learnable")
    # DeepSeek Sparse Attention: each query attends to its lightning indexer's top-k keys (models.sparse_attention)
    sparse_attention = False
    # q_proj yields each head's query and then its output gate; sigmoid(gate) scales the attention output before
    # o_proj (Qwen3-Next, Qwen3.5: Megatron's attention_output_gate)
    attention_output_gate = False
    # Every RMSNorm of the decoder scales by (1 + weight), the weight stored zero-centred (Qwen3-Next, Qwen3.5:
    # Megatron's layernorm_zero_centered_gamma, run by models.layers.ZeroCenteredRMSNorm on the stored weights)
    zero_centered_norms = False
    # Weight-map names of the MoE block: the HF module holding router and experts, one expert's gate/up/down
    # projections, and the module of the shared expert(s), if any.
    moe_block = "mlp"
    expert_projections = ("gate_proj", "up_proj", "down_proj")
    # The checkpoints stack each layer's experts ([E, ...] tensors) and nothing reads them per expert (gpt-oss, as
    # OpenAI releases it, transformers saves it and SGLang loads it): exports and syncs stack them too.
    stacked_experts_only = False
    shared_experts_module = "mlp.shared_experts"

    def __str__(self) -> str:
        return self.model_type

    def carries(self, key: str) -> bool:
        """Whether the checkpoint tensor `key` is carried as it is (carried_prefixes), not mapped to Megatron."""
        return key.startswith(self.carried_prefixes) if self.carried_prefixes else False

    def __repr__(self) -> str:
        return f"<family {self.model_type or '(generic)'}>"

    # ---- config.json -> architecture facts ---------------------------------------------------------------------
    def config(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """`hf` with transformers' defaults filled in for the keys this family reads, under the names read here."""
        cfg = {**self.defaults, **hf}
        for alias, key in self.aliases.items():
            if alias in hf and key not in hf:
                cfg[key] = hf[alias]
        return cfg

    def architecture(self, hf: Mapping[str, Any], source: Path = Path("config.json")) -> ModelArchitecture:
        cfg = self.config(hf)

        def required(key: str) -> int:
            value = cfg.get(key)
            if whole_number(cfg, key) is None or value <= 0:
                raise ArchitectureError(f"{source}: {key} must be a positive integer, got {value!r}")
            return value

        num_attention_heads = required("num_attention_heads")
        hidden_size = required("hidden_size")
        num_layers = required("num_hidden_layers")
        vocab_size = required("vocab_size")
        num_experts = self.num_experts(cfg)
        # Mixtral has no moe_intermediate_size: its experts are sized by intermediate_size.
        expert_ffn_size = whole_number(cfg, "moe_intermediate_size") or (
            whole_number(cfg, "intermediate_size") if num_experts else None)
        shared_size, shared_gate = self.shared_experts(cfg, expert_ffn_size or 0) if num_experts else (0, False)
        return ModelArchitecture(
            source=source,
            model_type=str(cfg.get("model_type", "")),
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_attention_heads,
            # HF leaves this out when every head has its own key/value (plain multi-head attention).
            num_key_value_heads=whole_number(cfg, "num_key_value_heads") or num_attention_heads,
            vocab_size=vocab_size,
            intermediate_size=whole_number(cfg, "intermediate_size"),
            num_experts=num_experts,
            moe_intermediate_size=expert_ffn_size,
            num_experts_per_tok=whole_number(cfg, "num_experts_per_tok"),
            max_position_embeddings=whole_number(cfg, "max_position_embeddings"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
            head_dim=whole_number(cfg, "head_dim") or hidden_size // num_attention_heads,
            qkv_bias=self.qkv_bias(cfg),
            qk_norm=self.qk_norm(cfg),
            moe_layers=self.moe_layers(cfg, num_layers) if num_experts else (False,) * num_layers,
            shared_expert_intermediate_size=shared_size,
            shared_expert_gate=shared_gate,
            router_bias=bool(num_experts) and self.router_bias(cfg),
            mla=self.mla(cfg),
            num_mtp_layers=self.num_mtp_layers(cfg),
            vision=self.vision(cfg, source),
            biased_linears=self.biased_linears,
            attention_sinks=self.attention_sinks,
            qk_norm_over_all_heads=self.qk_norm_over_all_heads,
            indexer=self.indexer(cfg),
            attention_output_gate=self.attention_output_gate,
            linear_attention=self.linear_attention(cfg, num_layers),
        )

    def num_experts(self, cfg: Mapping[str, Any]) -> int:
        if self.expert_count_key is None:
            return 0
        return whole_number(cfg, self.expert_count_key) or 0

    def qkv_bias(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg.get("attention_bias"))

    def o_proj_bias(self, cfg: Mapping[str, Any]) -> bool:
        """Llama's attention_bias puts a bias on o_proj too."""
        return bool(cfg.get("attention_bias"))

    def sliding_window(self, cfg: Mapping[str, Any]) -> bool:
        """Whether some layer attends within a sliding window only."""
        return False

    def qk_norm(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def moe_layers(self, cfg: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
        """Per decoder layer, whether its MLP is routed (asked only of a model with experts)."""
        return (True,) * num_layers

    def shared_experts(self, cfg: Mapping[str, Any], expert_ffn_size: int) -> tuple[int, bool]:
        """(hidden size of all shared experts of a layer together, whether a learned gate scales them)."""
        return 0, False

    def router_bias(self, cfg: Mapping[str, Any]) -> bool:
        return False

    def mla(self, cfg: Mapping[str, Any]) -> MultiLatentAttention | None:
        return None

    def indexer(self, cfg: Mapping[str, Any]) -> tuple[int, int]:
        """(heads, head size) of a sparse-attention family's lightning indexer; (0, 0) for dense attention."""
        return 0, 0

    def num_mtp_layers(self, cfg: Mapping[str, Any]) -> int:
        return 0

    def linear_attention(self, cfg: Mapping[str, Any], num_layers: int) -> LinearAttention | None:
        """The Gated DeltaNet layers of a hybrid family's model; None for attention everywhere."""
        return None

    def vision(self, cfg: Mapping[str, Any], source: Path) -> VisionTower | None:
        """The image encoder of a vision-language family's model; None for a text-only family."""
        return None

    def rope(self, cfg: Mapping[str, Any]) -> Rope:
        params = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
        return Rope(theta=float(params.get("rope_theta", cfg["rope_theta"])),
                    kind=params.get("rope_type", params.get("type", "default")), params=params)

    # ---- what the bridge cannot express -------------------------------------------------------------------------
    def problems(self, cfg: Mapping[str, Any]) -> list[str]:
        """Why Megatron-Core cannot run this model as transformers does, one line each; [] when it can."""
        problems = []
        if cfg.get("hidden_act") != "silu":
            problems.append(f"hidden_act={cfg.get('hidden_act')!r} unsupported: only SwiGLU MLPs are bridged")
        if self.o_proj_bias(cfg):
            problems.append(f"attention_bias={cfg.get('attention_bias')!r} unsupported: transformers' {self.display_name} "
                            "then gives o_proj a bias too, which Megatron has only with every linear layer biased")
        if self.sliding_window(cfg):
            problems.append("sliding_window attention is unsupported (use_sliding_window / sliding_window)")
        rope = self.rope(cfg)
        if rope.kind not in self.rope_types:
            problems.append(f"rope_scaling.rope_type={rope.kind!r} unsupported for {self.model_type}")
        elif rope.kind == "llama3":
            problems += llama3_rope_problems(cfg, rope)
        return problems

    def check(self, hf: Mapping[str, Any]) -> None:
        """Raise UnsupportedModelError naming every problem (one line), if any."""
        problems = self.problems(self.config(hf))
        if problems:
            raise UnsupportedModelError("; ".join(problems))

    # ---- Megatron-Core config --------------------------------------------------------------------------------------
    def megatron_fields(self, arch: ModelArchitecture, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """TransformerConfig fields of this family's attention and routing; models.hf_config adds those every
        family sets alike (sizes, norms, SwiGLU, the expert count and MoE layer pattern, the layout)."""
        fields = self.attention_fields(arch, cfg)
        if arch.is_moe:
            fields.update(self.router_fields(cfg))
        if arch.shared_expert_intermediate_size:
            fields.update(moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
                          moe_shared_expert_gate=arch.shared_expert_gate)
        return fields

    def attention_fields(self, arch: ModelArchitecture, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return dict(num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim,
                    add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm)

    def mlp_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """TransformerConfig fields of the MLPs where they differ from the SwiGLU without biases every family but
        gpt-oss has (models.hf_config puts them over its own)."""
        return {}

    def config_attributes(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Attributes Megatron-Core reads from a TransformerConfig that are not fields of it (GPTModel's YaRN
        settings), set on the config once it is built."""
        return {}

    def router_fields(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Megatron's router settings for this family's (a softmax over the top-k logits: Megatron's default)."""
        return {}

    # ---- weight map: `rules` is the models.weight_map.WeightMap being built ------------------------------------------
    def mixer_rules(self, rules, m: str, h: str, arch: ModelArchitecture, layer: int) -> None:
        """Rules of decoder layer `layer`'s token mixer, Megatron prefix `m` (…layers.N.), HF prefix `h`: its
        attention, here; a hybrid family's linear-attention layers differ."""
        rules.add(m + "self_attention.linear_proj.weight", [h + "self_attn.o_proj.weight"])
        self.attention_rules(rules, m + "self_attention.", h + "self_attn.", arch)

    def attention_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        """Rules of one layer's attention, Megatron prefix `m` (…self_attention.), HF prefix `h` (…self_attn.)."""
        rules.add(m + "linear_qkv.weight", [h + f"{p}_proj.weight" for p in "qkv"], QKV)
        if arch.qkv_bias:
            rules.add(m + "linear_qkv.bias", [h + f"{p}_proj.bias" for p in "qkv"], QKV)
        if arch.qk_norm:
            rules.add(m + "q_layernorm.weight", [h + "q_norm.weight"])
            rules.add(m + "k_layernorm.weight", [h + "k_norm.weight"])

    def moe_rules(self, rules, m: str, h: str, arch: ModelArchitecture) -> None:
        """Rules of one MoE layer's MLP, Megatron prefix `m` (…mlp.), HF prefix `h` (the decoder layer's)."""
        block = f"{h}{self.moe_block}."
        rules.add(m + "router.weight", [block + "gate.weight"])
        if arch.router_bias:
            rules.add(m + "router.expert_bias", [block + "gate.e_score_correction_bias"])
        rules.experts(m + "experts.", block + "experts.", self.expert_projections)
        if arch.shared_expert_intermediate_size:
            rules.glu_mlp(m + "shared_experts.", f"{h}{self.shared_experts_module}.")

    def vision_rules(self, rules, vision: VisionTower) -> None:
        """Rules of the image encoder (a vision-language family's)."""

    def build_vision_tower(self, hf: Mapping[str, Any], dtype):
        """The image encoder as a torch module, for the first pipeline stage of a vision-language family's model."""
        raise NotImplementedError(f"{self.display_name} has no vision tower")

    # ---- export --------------------------------------------------------------------------------------------------
    def same_bucket(self, cfg: Mapping[str, Any]) -> tuple[SameBucket, ...]:
        """Tensors an inference engine must receive together in one weight update."""
        return ()


def llama3_rope_scaling(cfg: Mapping[str, Any], rope: Rope) -> dict[str, Any]:
    """The four fields of Llama-3 rope scaling as transformers reads them: it requires the three factors and takes
    original_max_position_embeddings from the config's top level, else the rope dict, else max_position_embeddings
    (llama3_rope_problems says when one is missing)."""
    params = rope.params
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    return dict(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]), original_max_position_embeddings=original)


def llama3_rope_problems(cfg: Mapping[str, Any], rope: Rope) -> list[str]:
    missing = [field for field in ("factor", "low_freq_factor", "high_freq_factor") if rope.params.get(field) is None]
    if missing:
        return [f"rope_scaling (rope_type llama3) lacks {' and '.join(missing)}; "
                "transformers requires factor, low_freq_factor and high_freq_factor"]
    if not (cfg.get("original_max_position_embeddings") or rope.params.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings")):
        return ["rope_scaling (rope_type llama3) lacks original_max_position_embeddings, "
                "and config.json has no max_position_embeddings to fall back on"]
    return []
