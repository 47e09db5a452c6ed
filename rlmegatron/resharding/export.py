"""Streaming export of a live Megatron model, at any TP/PP/VPP/EP/ETP layout, as HF-named full tensors.

Every rank runs `export_hf_weights` and receives the same stream, one tensor (or,
for experts, one EP group of tensors) at a time, so extra memory stays near the
largest tensor. All ranks issue the same collectives in the same order:

1. a one-off plan: every rank's weight names, shapes and owning pipeline stage;
2. per weight, in the weight map's order: a broadcast of each rank's shard from
   the owning pipeline stage to the same rank of the others, so only shards
   cross between stages (whole tensors would carry TP x EP times the bytes over
   the links between nodes);
3. on every stage, the TP (or expert-TP) all-gather, in row chunks of at most
   `gather_chunk_bytes` written straight into their places in the full tensor
   (the per-rank fc1 layout undone on the way), so the gather costs the full
   tensor plus one chunk (and, on a stage that received it, the shard); for
   experts, then an EP all-gather of the same local expert slot, which yields
   the experts of every EP rank under their global ids;
4. the weight map's `megatron_to_hf` (QKV split, fc1 split, vocab padding stripped).

`export_hf` writes that stream as an HF safetensors checkpoint. Megatron is imported inside the functions that use
it, so importing this module, like models.weight_map, costs no Megatron import.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping, Optional, Sequence

import torch

from rlmegatron.models.fp8 import BlockFP8
from rlmegatron.models.mxfp4 import MXFP4
from rlmegatron.models.lora import is_adapter_name
from rlmegatron.models.weight_map import WeightMap, canonical_name, global_layers

_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class _Entry:
    """One Megatron weight as the plan sees it."""

    name: str  # weight-map name: global layer and expert ids
    local_name: str  # this rank's module path (same on every rank of the owning stage)
    pp_stage: int
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: Optional[int]  # TP-sharded dim, None if replicated
    frozen: bool = False  # a frozen image encoder's or MTP layer's weight: it cannot differ from what engines hold
    mtp_layer: Optional[int] = None  # the MTP layer the weight belongs to


def _partition_dim(module: torch.nn.Module, param_name: str, param: torch.Tensor) -> Optional[int]:
    """The TP-sharded dim of a weight, from Megatron's attributes or, when initialisation was skipped, its module."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    if isinstance(module, RowParallelLinear):
        return 1 if param_name == "weight" else None
    return None


def _local_weights(chunks) -> list[tuple[str, str, torch.Tensor, Optional[int], torch.nn.Module]]:
    """(weight-map name, local name, tensor, partition dim, owning module) for every parameter and filled buffer of
    this rank; LoRA factors are not weights of their own (see `merged`)."""
    from megatron.core import parallel_state as ps

    weights = []
    for chunk_id, chunk in enumerate(chunks):
        model = chunk.module if hasattr(chunk, "module") else chunk
        layers = global_layers(model)
        num_experts = model.config.num_moe_experts or 0
        expert_offset = ps.get_expert_model_parallel_rank() * (num_experts // ps.get_expert_model_parallel_world_size())
        modules = dict(model.named_modules())
        tensors = [(n, p) for n, p in model.named_parameters()]
        tensors += [(n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
        for local_name, tensor in tensors:
            if is_adapter_name(local_name):
                continue
            module_name, _, attr = local_name.rpartition(".")
            dim = _partition_dim(modules[module_name], attr, tensor)
            name = canonical_name(local_name, layers, expert_offset)
            weights.append((name, f"{chunk_id}:{local_name}", tensor, dim, modules[module_name]))
    return weights


class HFWeightExporter:
    """Plans once per model, then streams HF-named full tensors on every call (e.g. every training step)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], weight_map: WeightMap, gather_chunk_bytes: int = 16 << 20):
        from megatron.core import parallel_state as ps

        self.weight_map = weight_map
        self.gather_chunk_bytes = gather_chunk_bytes
        local = _local_weights(chunks)
        self._local = {name: (tensor, dim) for name, _, tensor, dim, _ in local}
        # A LoRA-adapted weight leaves as weight + scale * B @ A (adapters on), merged on its shard before the gather.
        self._adapted = {name: module for name, _, tensor, _, module in local
                         if tensor is getattr(module, "weight", None) and hasattr(module, "merged_weight")}
        stage = ps.get_pipeline_model_parallel_rank()
        mine = [_Entry(name, local_name, stage, tuple(t.shape), t.dtype, dim,
                       # Buffers (a router's expert bias) move outside the optimizer: never frozen.
                       frozen=name.startswith(("vision.", "mtp.")) and isinstance(t, torch.nn.Parameter)
                       and not t.requires_grad,
                       mtp_layer=int(m.group(1)) if (m := _MTP_LAYER.match(name)) else None)
                for name, local_name, t, dim, _ in local]
        everyone: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        entries: dict[str, _Entry] = {}
        for rank_entries in everyone:
            for entry in rank_entries:
                entries.setdefault(entry.name, entry)
        missing = [n for n, rule in weight_map.rules.items() if rule.exported and n not in entries]
        if missing:
            raise ValueError(f"the model has no weight for {len(missing)} weight-map rules, e.g. {missing[:5]}")
        self._plan = [entries[n] for n in weight_map.rules if n in entries and weight_map.rules[n].exported]
        self.num_experts = next(iter(chunks)).config.num_moe_experts or 0
        self.ep_size = ps.get_expert_model_parallel_world_size()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.stream()

    def stream(self, dtype: Optional[torch.dtype] = None, skip_frozen: bool = False,
               mtp_layers: Optional[int] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) for every exported weight, identically on every rank. `skip_frozen` leaves
        out a frozen image encoder and frozen MTP layers (a sync after engines already hold them). `mtp_layers`:
        only the first that many MTP layers, without their copies of the embedding and output head, which is what
        an engine loads (SGLang's NEXTN draft loads the first MTP layer and takes embedding and head from the main
        model; a server that does not draft loads none, and neither does the local engine); None: every MTP layer
        and its copies, as a checkpoint holds them."""
        named = self._megatron_stream(skip_frozen, mtp_layers)
        for hf_name, value in self.weight_map.hf_stream(named, copies=mtp_layers is None):
            yield hf_name, value if dtype is None else value.to(dtype)

    def _megatron_stream(self, skip_frozen: bool, mtp_layers: Optional[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """(weight-map name, full Megatron tensor) of every exported weight, identically on every rank."""
        local_experts = self.num_experts // self.ep_size if self.num_experts else 0
        for entry in self._plan:
            if (skip_frozen and entry.frozen) or (mtp_layers is not None and entry.mtp_layer is not None
                                                  and entry.mtp_layer >= mtp_layers):
                continue
            expert = _EXPERT.search(entry.name)
            if expert and self.ep_size > 1:
                if int(expert.group(1)) >= local_experts:
                    continue  # produced with the same slot of EP rank 0, by one all-gather
                yield from self._expert_group(entry, int(expert.group(1)), local_experts).items()
            else:
                yield entry.name, self._full_megatron_tensor(entry, entry.name)

    def adapter_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT name, full tensor) of every LoRA factor, identically on every rank: the split factor gathered like
        its weight, then named and split like its weight's HF tensors (a fused QKV or gate/up weight's B splits by
        rows into the HF projections, which share its A). Dense models on one pipeline stage (spec checks)."""
        for name in [entry.name for entry in self._plan if entry.name in self._adapted]:
            module = self._adapted[name]
            a, b = module.lora_A.detach(), module.lora_B.detach()
            _, dim = self._local[name]
            if module._lora_column:
                b = self._gather_tp(name, b, dim)
            else:
                a = self._gather_tp(name, a, dim)
            for hf_name, b_part in self.weight_map.megatron_to_hf(name, b).items():
                prefix = "base_model.model." + hf_name.removesuffix(".weight")
                a_part = a if module._lora_column else self.weight_map.megatron_to_hf(name, a)[hf_name]
                yield f"{prefix}.lora_A.weight", a_part
                yield f"{prefix}.lora_B.weight", b_part

    def module_stream(self, modules: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT name, full tensor) of the weights of the GPTModel children `modules` (LoRA's modules_to_save), as
        trained, identically on every rank: named like their HF tensors, as PEFT saves a module it trains whole."""
        tied = self.weight_map.facts.tie_word_embeddings
        for entry in self._plan:
            if entry.name.partition(".")[0] in modules:
                for hf_name, value in self.weight_map.megatron_to_hf(
                        entry.name, self._full_megatron_tensor(entry, entry.name)).items():
                    yield f"base_model.model.{hf_name}", value
                    if tied and entry.name.startswith("embedding."):  # PEFT saves the tied lm_head's copy too
                        yield "base_model.model.lm_head.weight", value

    def _expert_group(self, entry: _Entry, slot: int, local_experts: int) -> dict[str, torch.Tensor]:
        """Full tensors of local expert `slot` of every EP rank, keyed by weight-map name (global ids)."""
        from megatron.core import parallel_state as ps

        names = [_EXPERT.sub(f".local_experts.{r * local_experts + slot}.", entry.name) for r in range(self.ep_size)]
        mine = self._full_megatron_tensor(entry, names[ps.get_expert_model_parallel_rank()])
        gathered = [torch.empty_like(mine) for _ in range(self.ep_size)]
        torch.distributed.all_gather(gathered, mine, group=ps.get_expert_model_parallel_group())
        return dict(zip(names, gathered))

    def _full_megatron_tensor(self, entry: _Entry, name: str) -> torch.Tensor:
        """The full (TP-gathered) Megatron tensor, on every rank: the owning stage's shard, broadcast to the other
        stages, then gathered over TP on each."""
        from megatron.core import parallel_state as ps

        shard = None
        if ps.get_pipeline_model_parallel_rank() == entry.pp_stage:
            tensor, _ = self._local[name]
            adapted = self._adapted.get(name)
            shard = adapted.merged_weight() if adapted is not None and adapted.lora_enabled else tensor.detach()
        return self._gather_tp(name, self._shard_from_stage(entry, shard), entry.partition_dim)

    def _gather_tp(self, name: str, shard: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        if ".local_experts." in name:
            group, size = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
        else:
            group, size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        if dim is None or size == 1:
            return shard
        shard = shard.contiguous()
        full_shape = list(shard.shape)
        full_shape[dim] *= size
        full = torch.empty(full_shape, dtype=shard.dtype, device=shard.device)
        pieces = self.weight_map.tp_pieces(name, shard.shape[dim], size)
        row_bytes = shard[0].numel() * shard.element_size()
        rows = max(1, self.gather_chunk_bytes // (size * row_bytes))
        # Chunks run over the shard's rows (contiguous); along dim 0 they stay inside one piece.
        for start, length, targets in pieces if dim == 0 else [(0, shard.shape[0], None)]:
            for a in range(start, start + length, rows):
                b = min(a + rows, start + length)
                gathered = torch.empty((size * (b - a), *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
                torch.distributed.all_gather_into_tensor(gathered, shard[a:b], group=group)
                gathered = gathered.view(size, b - a, *shard.shape[1:])
                for rank in range(size):
                    if dim == 0:
                        full.narrow(0, targets[rank] + a - start, b - a).copy_(gathered[rank])
                        continue
                    for piece_start, piece_length, piece_targets in pieces:
                        full[a:b].narrow(dim, piece_targets[rank], piece_length).copy_(
                            gathered[rank].narrow(dim, piece_start, piece_length))
        return full

    def _shard_from_stage(self, entry: _Entry, shard: Optional[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of `entry` from the rank of the owning stage that holds it (None here off that stage)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return shard
        shard = torch.empty(entry.local_shape, dtype=entry.dtype, device=_device()) if shard is None \
            else shard.contiguous()
        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_process_group_ranks(group)[entry.pp_stage]
        torch.distributed.broadcast(shard, src=src, group=group)
        return shard


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def export_hf_weights(chunks, weight_map: WeightMap, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One-shot stream of HF-named full tensors from a live model (see HFWeightExporter to reuse the plan)."""
    return HFWeightExporter(chunks, weight_map).stream(dtype)


def export_peft_adapter(exporter: HFWeightExporter, out: str, lora, base_model: str) -> None:
    """Write a LoRA actor's adapters (through its exporter, whose plan a caller keeps across versions) as a PEFT
    adapter (adapter_model.safetensors + adapter_config.json) that transformers + peft, and SGLang's LoRA loading,
    read over the base HF model. Collective; rank 0 writes."""
    # Cloned: the projections of one fused weight share its A, and safetensors refuses shared memory.
    tensors = {name: tensor.detach().cpu().clone() for name, tensor in exporter.adapter_stream()}
    saved = {name: tensor.detach().cpu().clone() for name, tensor in exporter.module_stream(lora.modules_to_save)}
    if torch.distributed.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        modules = sorted({name.split(".lora_")[0].rpartition(".")[2] for name in tensors})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                  "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none",
                  "base_model_name_or_path": base_model}
        if saved:
            # A tied output layer is the embedding: PEFT re-ties it to the trained copy it loads.
            config.update(modules_to_save=sorted({name.rsplit(".", 2)[-2] for name in saved}),
                          ensure_weight_tying=True)
        tensors.update(saved)
        save_safetensors(tensors, os.path.join(out, "adapter_model.safetensors"))
        Path(out, "adapter_config.json").write_text(json.dumps(config, indent=1))
    torch.distributed.barrier()


def export_hf(chunks, weight_map: WeightMap, out: str, config: dict, max_shard_bytes: int = 5 * 2**30,
              quantisation: Optional[BlockFP8 | MXFP4] = None, original_scales=None,
              carried: Mapping[str, torch.Tensor] = MappingProxyType({})) -> None:
    """Write the model, at any layout, as HF safetensors shards, their index and config.json; with `quantisation`,
    in that format (block-wise FP8, or MXFP4 experts), each weight it quantises quantised as it streams
    (config.json gets its quantization_config), its blocks or groups keeping the `original_scales`
    (BlockFP8.quantised_stream, MXFP4.quantised_stream) that still reproduce them; the checkpoint tensors the
    family `carried` (models.carried) are written as they are.

    Collective: every rank streams the gathered tensors (HFWeightExporter); rank 0 writes each shard as soon as
    it is full, so it holds at most one shard beyond its own weights.
    """
    writer = torch.distributed.get_rank() == 0
    staging = Path(out, ".incomplete")
    if writer:
        staging.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_keys: list[list[str]] = []
    total = 0

    def flush():
        if shard:
            save_safetensors(shard, str(staging / f"shard-{len(shard_keys)}.safetensors"))
            shard_keys.append(sorted(shard))
            shard.clear()

    stream = HFWeightExporter(chunks, weight_map).stream()
    if quantisation is not None:
        # The unquantised tensors in bf16, as DeepSeek-V3, Qwen3-FP8 and gpt-oss hold them.
        stream = quantisation.quantised_stream(stream, others=torch.bfloat16, original_scales=original_scales)
        config = {**config, "quantization_config": quantisation.config}
    # The tensors the bridge carries as they are (models.carried) after the model's own, by rank 0 alone.
    for key, value in itertools.chain(stream, carried.items() if writer else ()):
        if not writer:
            continue
        if shard and sum(t.nbytes for t in shard.values()) + value.nbytes > max_shard_bytes:
            flush()
        shard[key] = value.detach().cpu().contiguous()
        total += value.nbytes
    if writer:
        flush()
        names = [f"model-{i + 1:05d}-of-{len(shard_keys):05d}.safetensors" for i in range(len(shard_keys))]
        for i, name in enumerate(names):
            os.replace(staging / f"shard-{i}.safetensors", Path(out, name))
        staging.rmdir()
        index = {"metadata": {"total_size": total},
                 "weight_map": {key: name for name, keys in zip(names, shard_keys) for key in keys}}
        Path(out, "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        Path(out, "config.json").write_text(json.dumps(config, indent=1))
    torch.distributed.barrier()


def save_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """A safetensors file readable as every other file of the export is (0666 less the umask: 0644 by default):
    safetensors (0.8) writes its files mode 0600, whoever else is to read them (an inference server's user)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0o022)  # the only way to read it is to set it
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
