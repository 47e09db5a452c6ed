"""The declarative, bidirectional Megatron <-> HF weight map of every bridged family, over full tensors.

The skeleton every family shares is here (embedding, norms, head, dense MLPs, experts, MTP layers); each
family's attention and MoE rules are its own (models.families: attention_rules, moe_rules).

A rule says: this Megatron parameter (full, unsharded, global layer index and
global expert id, local-spec names) is built from these HF tensors by this
transform. The transforms are chosen so that applying them to the i-th of TP
equal chunks of every source (along the parameter's partition dim) yields the
i-th TP shard: the QKV interleave is per query group and GLU fc1 is
[gate_i; up_i] per rank. That lets the converter read only its slices, and lets
online sync use the same rules on full tensors (`hf_to_megatron` /
`megatron_to_hf`). Megatron is imported only where a built model is read (global_layers): the converter's checks
use the map without it.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from rlmegatron.models.families.base import CONCAT, GLU, IDENTITY, QKV, VOCAB, Source
from rlmegatron.models.hf_config import ModelFacts
from rlmegatron.models.pipeline import pipeline_stage_layers


class WeightMapError(ValueError):
    """HF keys no rule maps, Megatron parameters nothing fills, or tensors of the wrong shape."""


@functools.lru_cache(maxsize=None)
def mtp_layer_attribute() -> str:
    """The name of an MTP layer's transformer layer in Megatron-Core's modules: `transformer_layer` in 0.16,
    `mtp_model_layer` in 0.19 (whose MTP layers may also be hybrid stacks). Read from the installed class, so that
    every version this package supports (setup.py) maps its own names."""
    import inspect

    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return "mtp_model_layer" if "self.mtp_model_layer" in inspect.getsource(MultiTokenPredictionLayer) \
        else "transformer_layer"


@dataclass(frozen=True)
class Rule:
    megatron: str
    sources: tuple[Source, ...]
    transform: str = IDENTITY
    exported: bool = True  # False: a Megatron copy of a tensor another rule exports (tied output layer)
    # HF keys holding the (single) source again, as DeepSeek's and GLM's MTP layers hold the embedding and output
    # head: written on export, and on import checked equal to the source, since Megatron keeps one copy.
    copies: tuple[str, ...] = ()


# Names of the same Megatron tensor under Transformer Engine / grouped-GEMM specs -> the local-spec name.
_ALIASES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"self_attention\.linear_q_up_proj\.layer_norm_weight$"), "self_attention.q_layernorm.weight"),
    (re.compile(r"self_attention\.linear_kv_up_proj\.layer_norm_weight$"), "self_attention.kv_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (re.compile(r"mlp\.experts\.linear_fc(\d)\.weight(\d+)$"), r"mlp.experts.local_experts.\2.linear_fc\1.weight"),
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def canonical_name(local_name: str, layer_offset: Mapping[int, int] | int = 0, expert_offset: int = 0) -> str:
    """Rank-local Megatron name (any spec) -> the map's name: local-spec form, global layer and expert ids.

    `layer_offset` is a dict local layer index -> global layer index, or a constant offset. MTP layers
    (`mtp.layers.K.`) all live on the last pipeline stage, so their local index is already global.
    """
    name = local_name.removeprefix("module.")
    for pattern, replacement in _ALIASES:
        name = pattern.sub(replacement, name)
    if match := _LAYER.match(name):
        local = int(match.group(1))
        global_layer = layer_offset[local] if isinstance(layer_offset, Mapping) else local + layer_offset
        name = f"decoder.layers.{global_layer}." + name[match.end():]
    if match := _EXPERT.search(name):
        name = f"{name[:match.start()]}.local_experts.{int(match.group(1)) + expert_offset}.{name[match.end():]}"
    return name


def global_layers(model) -> dict[int, int]:
    """Local -> global decoder layer index of this rank's GPTModel chunk, by the one pipeline split
    (models.pipeline.pipeline_stage_layers); a model Megatron built otherwise is an error, not a
    checkpoint with misnamed layers."""
    from megatron.core import parallel_state as ps

    config = model.config
    split = pipeline_stage_layers(config.num_layers, config.pipeline_model_parallel_size,
                                  config.virtual_pipeline_model_parallel_size,
                                  config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage)
    expected = list(split[ps.get_pipeline_model_parallel_rank()][model.vp_stage or 0])
    built = [layer.layer_number - 1 for layer in model.decoder.layers]
    if built != expected:
        raise WeightMapError(f"Megatron built decoder layers {built} on pipeline rank "
                             f"{ps.get_pipeline_model_parallel_rank()}, virtual stage {model.vp_stage}; "
                             f"the pipeline split puts {expected} there")
    return dict(enumerate(expected))


class WeightMap:
    """Every rule of one model (its family and sizes), keyed by Megatron name."""

    def __init__(self, facts: ModelFacts, stacked_experts: bool = False, value_head: Sequence[str] = ()):
        """`value_head`: the HF keys of a reward/value model's scalar head (`score.weight`, maybe `score.bias`),
        which then fill the critic's value head in place of the LM head."""
        self.facts = facts
        self.value_head = tuple(value_head)
        self.head_dim = facts.arch.head_dim
        self.num_query_groups = facts.arch.num_key_value_heads
        self.num_experts = facts.arch.num_experts
        self.stacked_experts = stacked_experts
        self.rules: dict[str, Rule] = {}
        self._build()
        # Stacked HF experts are exported per expert, the form transformers saves and loads, but for a family whose
        # checkpoints only ever stack them (gpt-oss), which is exported stacked as it was read (hf_stream).
        restack = stacked_experts and not facts.family.stacked_experts_only
        self._export_map = WeightMap(facts, False, self.value_head) if restack else self

    # ---- the table (families add their rules through `add`, `glu_mlp` and `experts`) ------------------------
    def add(self, megatron: str, hf: Sequence[str | Source], transform: str = IDENTITY, exported: bool = True,
            copies: Sequence[str] = ()):
        sources = tuple(s if isinstance(s, Source) else Source(s) for s in hf)
        self.rules[megatron] = Rule(megatron, sources, transform, exported, tuple(copies))

    def _build(self) -> None:
        facts = self.facts
        lm = facts.family.hf_language_prefix
        mtp_prefixes = [f"{lm}layers.{facts.num_layers + k}." for k in range(facts.num_mtp_layers)]
        embedding_copies = [h + "embed_tokens.weight" for h in mtp_prefixes]
        head_copies = [h + "shared_head.head.weight" for h in mtp_prefixes]
        if facts.tie_word_embeddings:  # the embedding rule is the one that exports the head
            embedding_copies, head_copies = embedding_copies + head_copies, []
        self.add("embedding.word_embeddings.weight", [f"{lm}embed_tokens.weight"], VOCAB, copies=embedding_copies)
        self.add("decoder.final_layernorm.weight", [f"{lm}norm.weight"])
        lm_head = f"{lm}embed_tokens.weight" if facts.tie_word_embeddings else facts.family.hf_lm_head
        if self.value_head:
            for key in self.value_head:
                self.add(f"output_layer.{key.rpartition('.')[2]}", [key])
        else:
            # Tied: the last pipeline stage still holds a copy of the embedding as output_layer.
            self.add("output_layer.weight", [lm_head], VOCAB, exported=not facts.tie_word_embeddings,
                     copies=head_copies)
        if facts.arch.vision is not None:
            facts.family.vision_rules(self, facts.arch.vision)
        moe_layers = facts.arch.moe_layers
        for layer in range(facts.num_layers):
            self._layer(f"decoder.layers.{layer}.", f"{lm}layers.{layer}.", layer, moe=moe_layers[layer])
        for k, h in enumerate(mtp_prefixes):
            m = f"mtp.layers.{k}."
            self.add(m + "enorm.weight", [h + "enorm.weight"])
            self.add(m + "hnorm.weight", [h + "hnorm.weight"])
            self.add(m + "eh_proj.weight", [h + "eh_proj.weight"])
            self.add(m + "final_layernorm.weight", [h + "shared_head.norm.weight"])
            # Megatron builds an MTP layer's transformer layer from the last decoder layer's spec.
            self._layer(m + mtp_layer_attribute() + ".", h, facts.num_layers - 1, moe=moe_layers[-1])

    def _layer(self, m: str, h: str, layer: int, moe: bool) -> None:
        """One decoder layer's rules; `layer` is the decoder layer whose spec Megatron built it from."""
        family, arch = self.facts.family, self.facts.arch
        self.add(m + "input_layernorm.weight", [h + "input_layernorm.weight"])
        self.add(m + "pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"])
        family.mixer_rules(self, m, h, arch, layer)
        if moe:
            family.moe_rules(self, m + "mlp.", h, arch)
        else:
            self.glu_mlp(m + "mlp.", h + "mlp.")

    def glu_mlp(self, m: str, h: str, names: Sequence[str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        """A SwiGLU MLP: Megatron's fused fc1 from HF's gate and up projections, fc2 from the down projection."""
        gate, up, down = names
        self.add(m + "linear_fc1.weight", [f"{h}{gate}.weight", f"{h}{up}.weight"], GLU)
        self.add(m + "linear_fc2.weight", [f"{h}{down}.weight"])

    def experts(self, m: str, h: str, names: Sequence[str]) -> None:
        """Every routed expert, Megatron prefix `m` (…experts.), HF prefix `h` (…experts.): one HF module per expert
        with projections `names`, or stacked [E, ...] tensors (gate_up_proj, down_proj), as some checkpoints hold them."""
        for e in range(self.num_experts):
            expert = f"{m}local_experts.{e}."
            if self.stacked_experts:
                self.add(expert + "linear_fc1.weight",
                         [Source(h + "gate_up_proj", e, (0, 2)), Source(h + "gate_up_proj", e, (1, 2))], GLU)
                self.add(expert + "linear_fc2.weight", [Source(h + "down_proj", e)])
            else:
                self.glu_mlp(expert, f"{h}{e}.", names)

    # ---- lookups ----------------------------------------------------------------------------
    def rule(self, megatron_name: str) -> Rule:
        try:
            return self.rules[megatron_name]
        except KeyError:
            raise WeightMapError(f"no {self.facts.family} rule fills Megatron parameter {megatron_name}") from None

    def hf_keys(self) -> set[str]:
        """Every HF key some rule reads."""
        return {key for rule in self.rules.values() for key in [s.key for s in rule.sources] + list(rule.copies)}

    def ignorable_hf_key(self, key: str) -> bool:
        """HF keys that carry no weights Megatron needs: rotary caches, an lm_head duplicating a tied embedding, and
        the tensors the family carries as they are (models.carried)."""
        family = self.facts.family
        return key.endswith("rotary_emb.inv_freq") or (self.facts.tie_word_embeddings and key == family.hf_lm_head) \
            or family.carries(key)

    def check_hf_keys(self, keys: set[str]) -> None:
        """Raise listing HF keys no rule maps (undeclared MTP layers named separately) and keys the rules need but lack."""
        unmapped = sorted(k for k in keys - self.hf_keys() if not self.ignorable_hf_key(k))
        declared = self.facts.num_layers + self.facts.num_mtp_layers
        layers = re.escape(self.facts.family.hf_language_prefix) + r"layers\.(\d+)\."
        undeclared = [k for k in unmapped if (m := re.match(layers, k)) and int(m.group(1)) >= declared]
        if undeclared:
            raise WeightMapError(
                f"the checkpoint has layers past num_hidden_layers + num_nextn_predict_layers = {declared}, "
                f"multi-token-prediction layers its config.json does not declare; {len(undeclared)} keys, e.g. {undeclared[:3]}"
            )
        if unmapped:
            raise WeightMapError(f"{len(unmapped)} HF keys no {self.facts.family} rule maps: {unmapped[:20]}")
        missing = sorted(self.hf_keys() - keys)
        if missing:
            raise WeightMapError(f"{len(missing)} HF tensors the {self.facts.family} map needs are absent: {missing[:20]}")

    # ---- transforms (full tensors, or matching TP chunks of every source) ----------------------
    def fuse(self, rule: Rule, tensors: Sequence[torch.Tensor], rows: Optional[int] = None) -> torch.Tensor:
        """HF tensors -> Megatron tensor; `rows` is the padded row count for the vocab transform."""
        if rule.transform == QKV:
            # q, k, v, or q, gate, k, v (an attention output gate): each query group's rows of each, in that order.
            groups = tensors[-2].shape[0] // self.head_dim
            grouped = [t.reshape(groups, -1, *t.shape[1:]) for t in tensors]
            return torch.cat(grouped, dim=1).reshape(-1, *tensors[0].shape[1:])
        if rule.transform in (GLU, CONCAT):
            return torch.cat(tensors, dim=0)
        (tensor,) = tensors
        if rule.transform == VOCAB and rows is not None and rows > tensor.shape[0]:
            padding = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
            return torch.cat([tensor, padding])
        return tensor

    def full_shape(self, rule: Rule, source_shape: Callable[[Source], tuple[int, ...]]) -> tuple[int, ...]:
        """Shape of the full Megatron tensor a rule builds, from its sources' shapes."""
        shapes = [source_shape(s) for s in rule.sources]
        rows = sum(shape[0] for shape in shapes)
        if rule.transform == VOCAB:
            rows = self.facts.padded_vocab_size
        return (rows, *shapes[0][1:])

    def split(self, rule: Rule, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Full Megatron tensor -> its HF tensors (in rule.sources order); inverse of `fuse`."""
        if rule.transform == QKV:
            heads = self.facts.arch.num_attention_heads
            per_group = heads // self.num_query_groups * self.head_dim
            sizes = [per_group] * (len(rule.sources) - 2) + [self.head_dim, self.head_dim]
            grouped = tensor.reshape(self.num_query_groups, sum(sizes), *tensor.shape[1:])
            return [t.reshape(-1, *tensor.shape[1:]) for t in torch.split(grouped, sizes, dim=1)]
        if rule.transform == GLU:
            return list(torch.chunk(tensor, 2, dim=0))
        if rule.transform == CONCAT:
            return list(torch.split(tensor, self._concat_rows(rule), dim=0))
        if rule.transform == VOCAB:
            return [tensor[: self.facts.vocab_size]]
        return [tensor]

    def tp_pieces(self, megatron_name: str, shard_len: int, size: int) -> list[tuple[int, int, list[int]]]:
        """Where the TP shards of a Megatron tensor go in the full tensor `split` takes, along the partition dim:
        (start in a shard, length, start in the full tensor for each TP rank) per contiguous piece.

        QKV shards hold whole query groups and vocab shards whole rows, so each shard is one piece;
        GLU fc1 shards are [gate_i; up_i] and regroup into [gate; up].
        """
        rule = self.rule(megatron_name)
        if rule.transform == GLU:
            half = shard_len // 2
            return [(0, half, [r * half for r in range(size)]), (half, half, [(size + r) * half for r in range(size)])]
        if rule.transform == CONCAT:
            # Shard r is [source 0's r-th chunk; source 1's r-th chunk; ...]; the full tensor is the sources in turn.
            pieces, in_shard, in_full = [], 0, 0
            for rows in self._concat_rows(rule):
                chunk = rows // size
                pieces.append((in_shard, chunk, [in_full + r * chunk for r in range(size)]))
                in_shard, in_full = in_shard + chunk, in_full + rows
            return pieces
        return [(0, shard_len, [r * shard_len for r in range(size)])]

    @staticmethod
    def _concat_rows(rule: Rule) -> list[int]:
        """The rows each source of a CONCAT rule gives the Megatron tensor."""
        return [source.rows.groups * source.rows.length for source in rule.sources]

    def hf_to_megatron(self, megatron_name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Full Megatron tensor from full HF tensors keyed by HF name (stacked sources indexed as needed)."""
        rule = self.rule(megatron_name)
        parts = []
        for source in rule.sources:
            tensor = tensors[source.key]
            parts.append(source.select(tensor[source.expert] if source.expert is not None else tensor))
        return self.fuse(rule, parts, rows=self.facts.padded_vocab_size)

    def check_copies(self, rule: Rule, source: torch.Tensor, read: Callable[[str], torch.Tensor]) -> None:
        """Raise unless each of the rule's HF copies, as `read` returns it, equals its source tensor."""
        for key in rule.copies:
            if not torch.equal(read(key), source):
                raise WeightMapError(
                    f"{key} differs from {rule.sources[0].key}: MTP layers share the main model's embedding "
                    f"and output head, and Megatron holds one tensor for both, so converting would lose one of them"
                )

    def hf_stream(self, named: Iterable[tuple[str, torch.Tensor]], copies: bool = True
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of a stream of full Megatron tensors (megatron_to_hf of each, with or without the
        rules' `copies`), with a stacked expert tensor (gpt-oss's [E, ...]) put together from its experts' pieces and
        yielded once all are in: the stream keeps one layer's stacked tensors at a time, since a layer's experts
        come one after another."""
        pieces = self._stacked_pieces
        stacks: dict[str, torch.Tensor] = {}
        filled: dict[str, int] = {}
        for name, tensor in named:
            rule = self._export_map.rule(name)
            if not rule.exported or not any(s.expert is not None for s in rule.sources) or self._export_map is not self:
                yield from self.megatron_to_hf(name, tensor, copies).items()
                continue
            for source, part in zip(rule.sources, self.split(rule, tensor)):
                if source.key not in stacks:
                    stacks[source.key] = part.new_empty((self.num_experts, *source.whole_slab_shape(part.shape)))
                    filled[source.key] = 0
                source.select(stacks[source.key][source.expert]).copy_(part)  # a view: chunks, slices, transposes
                filled[source.key] += 1
                if filled[source.key] == pieces[source.key]:
                    yield source.key, stacks.pop(source.key)

    @functools.cached_property
    def _stacked_pieces(self) -> dict[str, int]:
        """Per stacked HF tensor, the pieces the rules split it into (experts x gate/up halves)."""
        counts: dict[str, int] = {}
        for rule in self.rules.values():
            for source in rule.sources:
                if source.expert is not None:
                    counts[source.key] = counts.get(source.key, 0) + 1
        return counts

    def megatron_to_hf(self, megatron_name: str, tensor: torch.Tensor, copies: bool = True
                       ) -> dict[str, torch.Tensor]:
        """HF-named full tensors of one full Megatron tensor, with the copies a checkpoint names beside it (the MTP
        layers' embedding and head) unless not `copies`; {} for a tied copy."""
        rule = self._export_map.rule(megatron_name)
        if not rule.exported:
            return {}
        hf = {}
        for source, part in zip(rule.sources, self.split(rule, tensor)):
            if source.rows is None:
                hf[source.key] = part.contiguous()
                continue
            # Sources that are rows of one HF tensor (a fused projection's q, k, v, ...) fill it together.
            whole = hf.get(source.key)
            if whole is None:
                whole = hf[source.key] = part.new_empty(source.whole_slab_shape(part.shape))
            source.rows.place(whole, part)
        if not copies:
            return hf
        # Copies are clones: safetensors refuses to save tensors that share memory.
        return hf | {key: hf[rule.sources[0].key].clone() for key in rule.copies}
