"""LoRA adapters on a Megatron GPTModel's parallel linears (linear_qkv, linear_proj, linear_fc1, linear_fc2; the
experts' too), tensor-parallel like the layer they adapt.

A column-parallel layer (output split over TP) gets a replicated A [r, in] and a B [out/TP, r] split like its
weight; a row-parallel layer (input split) gets an A [r, in/TP] split like its weight and a replicated B [out, r].
So B @ A of the local shards is exactly this rank's shard of the full update, in the weight's own per-rank layout
(fc1's gate/up halves, QKV's query groups): merging is local, and the exporter gathers merged weights like the
base ones. The adapted layer keeps its class's behaviour and parameter names; the adapters add `lora_A` and
`lora_B` beside `weight`, and only they train.

Gradients: a replicated factor's gradient is a partial sum on each rank of the layer's TP group (its part of the
output, or of the sequence, uses it), so the factor enters the product through Megatron's copy-to-region (forward
as is, backward all-reduced); activations take the same path as the layer's own input and output.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch

from rlmegatron.models.weight_map import canonical_name, global_layers

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ADAPTER_PARAMS = ("lora_A", "lora_B")
SAVABLE = ("embedding", "output_layer")  # modules_to_save: the GPTModel's children that may train whole


@dataclass(frozen=True)
class LoRASettings:
    """`actor.lora`: the update of each targeted weight is (alpha / rank) * B @ A."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = TARGETS
    modules_to_save: tuple[str, ...] = ()
    """Of SAVABLE: modules that train whole beside the adapters (PEFT's modules_to_save)."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (or state-dict key) name is a LoRA factor's."""
    return name.rpartition(".")[2] in ADAPTER_PARAMS


class _LoRAMixin:
    """Forward, merge and checkpoint sharding of an adapted parallel linear; mixed into the layer's own class."""

    lora_scale: float
    lora_enabled: bool
    _lora_column: bool
    _lora_glu: bool

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if self.lora_enabled:
            output = output + self._lora_delta(input_).to(output.dtype)
        return output, bias

    def _lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        group = self.tp_group
        parallel = group.size() > 1
        a, b = self.lora_A, self.lora_B
        if self._lora_column:
            # The input as the layer itself sees it: gathered over the sequence, or its gradient summed over TP.
            if parallel and not self.explicit_expert_comm:
                x = (mappings.gather_from_sequence_parallel_region(x, group=group) if self.sequence_parallel
                     else mappings.copy_to_tensor_model_parallel_region(x, group=group))
            if parallel:
                a = mappings.copy_to_tensor_model_parallel_region(a, group=group)
            return torch.nn.functional.linear(torch.nn.functional.linear(self.lora_dropout(x), a), b) * self.lora_scale
        h = torch.nn.functional.linear(self.lora_dropout(x), a)  # a partial sum over TP, r columns wide
        if parallel and not self.explicit_expert_comm:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
            if self.sequence_parallel:  # the layer's output is this rank's slice of the sequence
                h = mappings.scatter_to_sequence_parallel_region(h, group=group)
                b = mappings.copy_to_tensor_model_parallel_region(b, group=group)
        elif parallel:
            # Experts whose dispatcher sums the partial outputs: the update is summed with them, B's gradient not.
            b = mappings.copy_to_tensor_model_parallel_region(b, group=group)
        return torch.nn.functional.linear(h, b) * self.lora_scale

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of weight + scale * B @ A, in the weight's layout and dtype."""
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.lora_scale
        return (self.weight.float() + delta).to(self.weight.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        # The layer's own method took the factors for replicated tensors; each is sharded like its weight or not.
        axes = {"lora_B": 0} if self._lora_column else {"lora_A": 1}
        for name in ADAPTER_PARAMS:
            key = f"{prefix}{name}"
            state[key] = make_sharded_tensors_for_checkpoint(
                {name: getattr(self, name)}, prefix, {name: axes[name]} if name in axes else {}, sharded_offsets,
                tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))[key]
            if name == "lora_B" and self._lora_glu:  # fc1's gate and up halves are split over TP separately
                # Megatron-Core 0.19 takes the layer's TP group (an expert's is not the dense one); 0.16 has none.
                group = ({"tp_group": self.tp_group}
                         if "tp_group" in inspect.signature(apply_swiglu_sharded_factory).parameters else {})
                state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets, **group)
        return state


_ADAPTED_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _ADAPTED_CLASSES:
        _ADAPTED_CLASSES[cls] = type(f"LoRA{cls.__name__}", (_LoRAMixin, cls), {})
    return _ADAPTED_CLASSES[cls]


def add_adapters(model: torch.nn.Module, settings: LoRASettings, seed: int) -> torch.nn.Module:
    """Freeze `model` and add LoRA factors to its targeted linears; returns the model. A starts from a seeded
    uniform(+-1/sqrt(in)) drawn as the full matrix, so every layout starts alike; B starts at zero, so the adapted
    model starts as the base model."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    model.requires_grad_(False)
    layers = global_layers(model)
    num_experts = model.config.num_moe_experts or 0
    expert_offset = (ps.get_expert_model_parallel_rank() * (num_experts // ps.get_expert_model_parallel_world_size())
                     if num_experts else 0)
    adapted = 0
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] not in settings.target_modules:
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(f"{name}: LoRA adapts Megatron's parallel linears, not {type(module).__name__} "
                             "(grouped-GEMM experts: set moe_grouped_gemm off)")
        _attach(module, settings, canonical_name(f"{name}.weight", layers, expert_offset), seed)
        adapted += 1
    if not adapted and (model.pre_process or model.decoder.layers):
        raise ValueError(f"LoRA target_modules {list(settings.target_modules)} match no layer of the model")
    # Each module to save trains whole; a copy of its base weights is what the adapters-off model (the reference,
    # the base weights an engine gets) uses. A tied output layer on a stage of its own is the embedding's copy.
    saved = [param for name, param in model.named_parameters()
             if name.partition(".")[0] in settings.modules_to_save
             or ("embedding" in settings.modules_to_save and getattr(param, "shared_embedding", False))]
    for param in saved:
        param.requires_grad_(True)
    model.lora_saved_modules = [(param, None) for param in saved]
    remember_base_weights([model])  # a random-init model's base; loading other weights takes a new copy
    if model.pre_process:
        # Frozen embeddings give activations that need no gradient, and activation recompute's checkpoints would
        # then drop the adapters' gradients: the embedding's output asks for one.
        model.embedding.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    return model


def _attach(module, settings: LoRASettings, weight_name: str, seed: int) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    column = isinstance(module, ColumnParallelLinear)
    if column and module.gather_output:
        raise ValueError(f"{weight_name}: LoRA needs the layer's output left split over TP")
    weight = module.weight
    tp_rank, tp_size = module.tp_group.rank(), module.tp_group.size()
    out_features = weight.shape[0] * (tp_size if column else 1)
    in_features = weight.shape[1] * (1 if column else tp_size)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{weight_name}".encode()))
    bound = 1.0 / math.sqrt(in_features)
    a = torch.empty(settings.rank, in_features).uniform_(-bound, bound, generator=generator)
    if not column:
        a = a.chunk(tp_size, dim=1)[tp_rank]
    b = torch.zeros(weight.shape[0] if column else out_features, settings.rank)
    module.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype))
    for name, param in (("lora_A", module.lora_A), ("lora_B", module.lora_B)):
        split = (name == "lora_B") if column else (name == "lora_A")
        # The grad norm counts a factor on every rank unless it is a duplicate over the layer's TP group (experts at
        # ETP=1 under TP>1 hold different experts on each TP rank: not duplicates).
        set_tensor_model_parallel_attributes(param, is_parallel=split or tp_size == 1, dim=0 if column else 1,
                                             stride=1)
        param.allreduce = getattr(weight, "allreduce", True)  # expert factors reduce over the expert-DP group
    module.lora_dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
    module.lora_scale = settings.scale
    module.lora_enabled = True
    module._lora_column = column
    module._lora_glu = column and weight_name.endswith("linear_fc1.weight") and module.config.gated_linear_unit
    module.__class__ = _adapted_class(type(module))


def _saved_modules(chunks) -> list:
    return [pair for chunk in chunks
            for pair in getattr(chunk.module if hasattr(chunk, "module") else chunk, "lora_saved_modules", [])]


def base_weight_copies(chunks) -> list[torch.Tensor]:
    """The copies `remember_base_weights` keeps: memory of the model's, offloaded with its parameters."""
    return [base for _, base in _saved_modules(chunks)]


def remember_base_weights(chunks) -> None:
    """The modules to save (LoRASettings.modules_to_save) hold the base model's weights now, as loaded: keep a copy for
    `adapters_disabled`. Called once the base weights are in, before any training or checkpoint load."""
    for chunk in chunks:
        model = chunk.module if hasattr(chunk, "module") else chunk
        if hasattr(model, "lora_saved_modules"):
            model.lora_saved_modules = [(param, param.detach().clone()) for param, _ in model.lora_saved_modules]


def adapted_modules(chunks) -> Iterator[_LoRAMixin]:
    for chunk in chunks:
        model = chunk.module if hasattr(chunk, "module") else chunk
        yield from (module for module in model.modules() if isinstance(module, _LoRAMixin))


def has_adapters(chunks) -> bool:
    return next(adapted_modules(chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(chunks) -> Iterator[None]:
    """The base model: every adapter of `chunks` off, and the modules to save at their base weights, for the block."""
    modules = list(adapted_modules(chunks))
    saved = _saved_modules(chunks)
    # The modules to save swap storage with their base copies, and back: no copy of a vocabulary-sized embedding
    # per reference pass and per weight push. Nothing trains inside the block, so the swapped-out views of Megatron's
    # parameter buffer are only held, untouched, until they come back.
    trained = [param.data for param, _ in saved]
    for module in modules:
        module.lora_enabled = False
    for param, base in saved:
        param.data = base
    try:
        yield
    finally:
        for module in modules:
            module.lora_enabled = True
        for (param, _), value in zip(saved, trained):
            param.data = value
