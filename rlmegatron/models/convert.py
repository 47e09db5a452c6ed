"""HF safetensors -> Megatron models, Megatron dist_checkpointing save/load, and logits, run on every rank.

Import streams: each rank reads, per parameter, only its TP/EP slice of each HF
tensor (`safe_open(...).get_slice`), fuses it with the weight map's rule and
copies it into the parameter. The way back, HF safetensors from any layout, is
resharding.export_hf; `rlm convert` (rlmegatron.entry.convert_command) puts the pieces together.
Megatron, safetensors and transformers are imported inside the functions that use them: HFCheckpoint's checks of a
checkpoint serve `rlm validate` and the converter's checks, which should not wait for them.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from rlmegatron.errors import UserError
from rlmegatron.models.fp8 import FP8_HEADER_DTYPE, SCALE_SUFFIX, BlockFP8, UnsupportedQuantization
from rlmegatron.models.mxfp4 import BLOCKS_SUFFIX, EXPERT_WEIGHTS, SCALES_SUFFIX, MXFP4
from rlmegatron.models.hf_config import (
    ModelFacts,
    UnsupportedModelError,
    build_gpt_model,
    model_facts,
    read_hf_config,
    transformer_config,
)
from rlmegatron.models.lora import is_adapter_name
from rlmegatron.models.weight_map import Source, WeightMap, WeightMapError, canonical_name, global_layers
from rlmegatron.runtime.distributed import ParallelLayout, init_model_parallel
from rlmegatron.runtime.sharded_save import save_sharded

META_FILE = "rlm_convert.json"  # next to the dist checkpoint: HF config and the facts export needs
# Next to it too, for a block-wise FP8 source: every FP8 weight's scale_inv as the checkpoint had it, which
# `mcore-to-hf --fp8` gives back to each block the weights still hold exactly (BlockFP8.quantise). A bf16 copy of
# the weights does not determine them (a scale has 24 significant bits), and they are 1/16384 of the weights' size.
SCALES_FILE = "fp8_scales.safetensors"
# Likewise for an MXFP4 source (gpt-oss): its experts' scales, which `mcore-to-hf --mxfp4` gives back to each group of
# 32 the weights still hold exactly (MXFP4.quantise). The values alone leave some groups' scales open (models.mxfp4);
# the scales are a byte per 32 weights, 1/64 of the bf16 experts.
MXFP4_SCALES_FILE = "mxfp4_scales.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


class ConversionError(UserError, ValueError):
    """A checkpoint is missing, incomplete, or does not fit the requested layout."""


class HFCheckpoint:
    """Lazy view of a HF safetensors checkpoint: which file holds each key, and sliced reads of it.

    Every shard's header is read when the view is made, so a truncated or corrupt file, or an FP8 weight whose
    scale is missing, is named before any rank builds a model. A block-wise FP8 checkpoint reads as its dequantised
    weights (models.fp8): `key_files` holds the weights, `scale_keys` each FP8 weight's scale. So does an MXFP4 one
    (models.mxfp4): `key_files` names each MXFP4 weight as its unquantised checkpoint would (…experts.gate_up_proj),
    `mxfp4_keys` its blocks and scales, and a read dequantises one expert's slab at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = read_hf_config(self.path)
        try:
            self.mxfp4 = MXFP4.from_hf_config(self.config)
            self.fp8 = None if self.mxfp4 else BlockFP8.from_hf_config(self.config)
        except UnsupportedQuantization as err:
            raise UnsupportedQuantization(f"{self.path / 'config.json'}: {err}") from None
        self._handles: dict[str, object] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                self.key_files = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ConversionError(f"{index}: not a safetensors index (no readable weight_map: {err!r})") from err
        elif (self.path / "model.safetensors").is_file():
            self.key_files = {key: "model.safetensors" for key in self._shard("model.safetensors").keys()}
        else:
            raise ConversionError(f"{self.path} has no model.safetensors or model.safetensors.index.json")
        absent = sorted({f for f in self.key_files.values() if not (self.path / f).is_file()})
        if absent:
            raise ConversionError(f"{self.path} is missing safetensors shards named by its index: {absent}")
        for file in sorted(set(self.key_files.values())):
            self._shard(file)
        self._files = self.key_files  # every tensor, weights, FP8 scales and MXFP4 blocks and scales: what _slice reads
        self.key_files = {key: file for key, file in self._files.items() if not key.endswith(SCALE_SUFFIX)}
        self.scale_keys = self._fp8_scales()
        self.mxfp4_keys = self._mxfp4_tensors()
        for weight, (blocks, scales) in self.mxfp4_keys.items():
            self.key_files[weight] = self.key_files.pop(blocks)
            del self.key_files[scales]

    def _fp8_scales(self) -> dict[str, str]:
        """{FP8 weight: its scale}; ConversionError names an FP8 weight without its scale, a scale without its
        weight, or a scale whose shape is not the weight's blocks."""
        scales = {key.removesuffix(SCALE_SUFFIX): key for key in self._files if key.endswith(SCALE_SUFFIX)}
        quantised = [key for key in self.key_files if self._slice(key).get_dtype() == FP8_HEADER_DTYPE]
        if quantised and self.fp8 is None:
            raise ConversionError(f"{self.path}: {quantised[0]} is float8_e4m3fn but config.json declares no "
                                  "quantization_config, so its scales' format is unknown")
        for key in quantised:
            if key not in scales:
                raise ConversionError(f"{self.path}: FP8 weight {key} has no scale: {key}{SCALE_SUFFIX} is missing")
            shape, scale_shape = self._slice(key).get_shape(), tuple(self._slice(scales[key]).get_shape())
            blocks = self.fp8.scale_shape(shape) if len(shape) >= 2 else None
            if scale_shape != blocks:
                raise ConversionError(
                    f"{self.path}: {scales[key]} has shape {list(scale_shape)}, not the "
                    f"{list(blocks or [])} blocks of {list(self.fp8.block)} that {key} {shape} has: "
                    "per-tensor or per-channel FP8 scales are not supported, only block-wise ones")
        orphans = sorted(scales.keys() - set(quantised))
        if orphans:
            raise ConversionError(f"{self.path}: {scales[orphans[0]]} scales {orphans[0]}, which is not a "
                                  "float8_e4m3fn tensor of the checkpoint")
        return {key: scales[key] for key in quantised}

    def _mxfp4_tensors(self) -> dict[str, tuple[str, str]]:
        """{MXFP4 weight: (its blocks, its scales)}; ConversionError names blocks without scales or scales without
        blocks, MXFP4 tensors that are not uint8 [E, out, in / 32, 16] blocks and [E, out, in / 32] scales, or that
        are not a stacked expert weight, and MXFP4 blocks in a checkpoint whose config.json does not declare them."""
        blocks = {key.removesuffix(BLOCKS_SUFFIX): key for key in self.key_files if key.endswith(BLOCKS_SUFFIX)}
        if self.mxfp4 is None:
            # A weight is never uint8: these are MXFP4 blocks whatever config.json says.
            packed = [key for key in blocks.values() if self._slice(key).get_dtype() == "U8"]
            if packed:
                raise ConversionError(f"{self.path}: {packed[0]} is MXFP4 blocks (uint8) but config.json declares no "
                                      "quantization_config mxfp4, so they cannot be read")
            return {}
        scales = {key.removesuffix(SCALES_SUFFIX): key for key in self.key_files if key.endswith(SCALES_SUFFIX)}
        for weight in sorted(blocks.keys() | scales.keys()):
            if weight not in scales:
                raise ConversionError(f"{self.path}: MXFP4 weight {blocks[weight]} has no scales: "
                                      f"{weight}{SCALES_SUFFIX} is missing")
            if weight not in blocks:
                raise ConversionError(f"{self.path}: {scales[weight]} scales {weight}{BLOCKS_SUFFIX}, which the "
                                      "checkpoint does not hold")
            if not EXPERT_WEIGHTS.search(weight):
                raise ConversionError(f"{self.path}: {blocks[weight]} is MXFP4, which is read for the stacked expert "
                                      "weights (…experts.gate_up_proj, …experts.down_proj) only")
            if weight in self.key_files:
                raise ConversionError(f"{self.path}: holds {weight} both unquantised and as MXFP4 "
                                      f"({blocks[weight]})")
            packed, scale = self._slice(blocks[weight]), self._slice(scales[weight])
            shape, scale_shape = packed.get_shape(), scale.get_shape()
            if (packed.get_dtype(), scale.get_dtype()) != ("U8", "U8") or len(shape) != 4 or shape[-1] != 16 \
                    or scale_shape != shape[:-1]:
                raise ConversionError(
                    f"{self.path}: {blocks[weight]} {packed.get_dtype()} {shape} with {scales[weight]} "
                    f"{scale.get_dtype()} {scale_shape} is not MXFP4 as gpt-oss ships it: uint8 blocks [experts, "
                    "out, in / 32, 16] and uint8 scales [experts, out, in / 32]")
        return {weight: (blocks[weight], scales[weight]) for weight in blocks}

    def _shard(self, file: str):
        """The open shard `file`; safetensors checks its header and that the file holds every tensor it lists."""
        if file not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                self._handles[file] = safe_open(self.path / file, "pt")
            except SafetensorError as err:
                raise ConversionError(f"{self.path / file}: truncated or corrupt safetensors file ({err})") from err
        return self._handles[file]

    def facts(self, tp: int) -> ModelFacts:
        """The model's facts, with MTP layers only when the checkpoint holds their tensors."""
        return model_facts(self.config, tp, keys=self.key_files)

    @property
    def stacked_experts(self) -> bool:
        return any(key.endswith("experts.gate_up_proj") for key in self.key_files)

    def _slice(self, key: str):
        return self._shard(self._files[key]).get_slice(key)

    def read(self, source: Source, dim: Optional[int] = None, rank: int = 0, size: int = 1,
             padded_rows: Optional[int] = None) -> torch.Tensor:
        """`source`, or its `rank`-th of `size` chunks along `dim`; `padded_rows` counts rows past the end
        (vocab padding) when chunking dim 0, and those rows are not read."""
        lead = () if source.expert is None else (source.expert,)
        if source.key in self.mxfp4_keys or source.reads_whole_slab:
            # One expert's slab read whole (MXFP4 dequantises whole groups; safetensors slices ranges only), then
            # selected and cut to this rank's chunk.
            if source.key in self.mxfp4_keys:
                slab = self._dequantised_mxfp4(source.key, lead)
            elif source.key in self.scale_keys:
                raise ConversionError(f"{self.path}: {source.key} is block-FP8 and stored transposed or interleaved, "
                                      "which the FP8 path does not read")
            else:
                slab = self._slice(source.key)[lead + (slice(None),)]
            values = source.select(slab)
            return (values if dim is None else torch.chunk(values, size, dim=dim)[rank]).contiguous()
        tensor = self._slice(source.key)
        shape = tensor.get_shape()[len(lead):]
        base, rows = 0, shape[0]
        if source.rows is not None:  # one group (reads_whole_slab takes more): a range of rows
            base, rows = source.rows.start, source.rows.length
        if source.part is not None:
            rows //= source.part[1]
            base = source.part[0] * rows
        index = [slice(None)] * len(shape)
        index[0] = slice(base, base + rows)
        if dim is not None:
            extent = (padded_rows or rows) if dim == 0 else shape[dim]
            chunk = extent // size
            start, stop = rank * chunk, (rank + 1) * chunk
            index[dim] = slice(base + min(start, rows), base + min(stop, rows)) if dim == 0 else slice(start, stop)
        values = tensor[lead + tuple(index)]
        if source.key not in self.scale_keys:
            return values
        # The window of the weight this read covers, and the scale blocks over it, dequantised one read at a time.
        start = tuple(0 if i.start is None else i.start for i in index[-2:])
        rows, cols = self.fp8.scale_window(start, values.shape[-2:])
        return self.fp8.dequantise(values, self._slice(self.scale_keys[source.key])[lead + (rows, cols)], start)

    def _dequantised_mxfp4(self, key: str, lead: tuple[int, ...]) -> torch.Tensor:
        """The float32 values of MXFP4 weight `key` [E, in, out], or of expert `lead`'s slab [in, out] of it: only
        that expert's blocks and scales are read. ConversionError when a scale puts values past float32's range
        (where bf16's ends too): the format's NaN scale 255, or a corrupt file."""
        blocks, scales = (self._slice(name)[lead + (slice(None),)] for name in self.mxfp4_keys[key])
        values = MXFP4.dequantise(blocks, scales)
        if not torch.isfinite(values).all():
            where = f"expert {lead[0]} of " if lead else ""
            raise ConversionError(f"{self.path}: {self.mxfp4_keys[key][1]}: the scales of {where}{key} put values "
                                  "past float32's range (or are 255, the MX format's NaN): a corrupt checkpoint")
        return values.transpose(-2, -1)  # stored out before in, as Megatron holds it; the HF weight is [in, out]

    def shape(self, source: Source) -> tuple[int, ...]:
        """Shape of what `source` names, from the safetensors header alone."""
        if source.key in self.mxfp4_keys:
            shape = MXFP4.weight_shape(self._slice(self.mxfp4_keys[source.key][0]).get_shape())
        else:
            shape = self._slice(source.key).get_shape()
        return source.slab_shape(shape[0 if source.expert is None else 1:])

    def close(self) -> None:
        self._handles.clear()


@dataclass(frozen=True)
class ConvertMeta:
    """What a dist checkpoint written by the converter records about its model."""

    hf_config: dict
    padded_vocab_size: int
    dtype: str
    stacked_experts: bool
    num_mtp_layers: Optional[int] = None  # None (files written before it was recorded): as config.json declares
    quantization_config: Optional[dict] = None  # a quantised source's, which `mcore-to-hf --fp8/--mxfp4` writes back

    def save(self, directory: str | Path) -> None:
        Path(directory, META_FILE).write_text(json.dumps(self.__dict__, indent=1))

    def facts(self, tp: int) -> ModelFacts:
        """The converted model's facts at TP `tp`: its padded vocabulary and MTP layers as converted."""
        return model_facts(self.hf_config, tp, padded_vocab=self.padded_vocab_size, mtp_layers=self.num_mtp_layers)

    @staticmethod
    def written_in(directory: str | Path) -> bool:
        """Whether `directory` holds a checkpoint written by the converter (rather than an HF one)."""
        return Path(directory, META_FILE).is_file()

    @classmethod
    def load(cls, directory: str | Path) -> "ConvertMeta":
        meta = Path(directory, META_FILE)
        if not meta.is_file():
            raise ConversionError(f"{directory} is not a checkpoint written by `rlm convert` (no {META_FILE})")
        try:
            return cls(**json.loads(meta.read_text()))
        except (ValueError, TypeError) as err:
            raise ConversionError(f"{meta}: unreadable ({err}); rewrite the checkpoint with "
                                  "`rlm convert hf-to-mcore`") from err


def build_chunks(facts: ModelFacts, layout: ParallelLayout, dtype: str, perform_initialization: bool = False):
    """This rank's model chunks (one per virtual pipeline stage) for `layout`; parallel groups must be set."""
    config = transformer_config(facts, layout, dtype, perform_initialization=perform_initialization)
    return [build_gpt_model(facts, config, vp_stage=vp if layout.vpp else None) for vp in range(layout.vpp or 1)]


def _named_weights(chunk) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(local name, tensor, is_parameter) for parameters and the buffers a rule can fill (router expert bias)."""
    for name, param in chunk.named_parameters():
        yield name, param, True
    for name, buffer in chunk.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buffer, False


def _placement(chunk) -> tuple[dict[int, int], int]:
    """(local -> global layer index, global id of this rank's first expert) for a chunk."""
    from megatron.core import parallel_state as ps

    layers = global_layers(chunk)
    experts = chunk.config.num_moe_experts or 0
    expert_offset = ps.get_expert_model_parallel_rank() * (experts // ps.get_expert_model_parallel_world_size())
    return layers, expert_offset


def canonical_weights(chunk) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(weight-map name, local tensor, is_parameter) of every weight in a chunk; LoRA factors are the adapters', not
    the model's."""
    layers, expert_offset = _placement(chunk)
    for name, tensor, is_param in _named_weights(chunk):
        if is_adapter_name(name):
            continue
        yield canonical_name(name, layers, expert_offset), tensor, is_param


def _tp_chunk(name: str, local_shape: torch.Size, full_shape: tuple[int, ...]) -> tuple[Optional[int], int, int]:
    """(partition dim or None, TP rank, TP size) of a local tensor, found by comparing shapes: Megatron only
    sets its partition attributes when it initialises weights, which conversion skips."""
    from megatron.core import parallel_state as ps

    dims = [d for d, (local, full) in enumerate(zip(local_shape, full_shape)) if local != full]
    if not dims:
        return None, 0, 1
    dim = dims[0]
    if ".local_experts." in name:
        rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    else:
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    if len(dims) > 1 or full_shape[dim] != local_shape[dim] * size:
        raise WeightMapError(f"{name}: local shape {tuple(local_shape)} is no TP={size} shard of {full_shape}")
    return dim, rank, size


def load_hf_weights(chunks, weight_map: WeightMap, checkpoint: HFCheckpoint, keep_initialised: tuple[str, ...] = ()
                    ) -> None:
    """Fill every weight of this rank's chunks from the HF checkpoint, reading only this rank's slices;
    `keep_initialised` names the Megatron parameters the checkpoint may lack (they keep their init)."""
    checkpoint_keys = set(checkpoint.key_files)
    weight_map.check_hf_keys(checkpoint_keys)
    unfilled = []
    with torch.no_grad():
        for chunk in chunks:
            for name, tensor, is_param in canonical_weights(chunk):
                rule = weight_map.rules.get(name)
                if rule is None:
                    unfilled.append(name) if is_param and name not in keep_initialised else None
                    continue
                dim, rank, size = _tp_chunk(name, tensor.shape, weight_map.full_shape(rule, checkpoint.shape))
                padded = weight_map.facts.padded_vocab_size if rule.transform == "vocab" else None
                parts = [checkpoint.read(s, dim, rank, size, padded) for s in rule.sources]
                weight_map.check_copies(rule, parts[0], lambda key: checkpoint.read(Source(key), dim, rank, size, padded))
                value = weight_map.fuse(rule, parts, rows=tensor.shape[0])
                if value.shape != tensor.shape:
                    raise WeightMapError(f"{name}: HF tensors give shape {tuple(value.shape)}, "
                                         f"Megatron expects {tuple(tensor.shape)} (rule sources {[s.key for s in rule.sources]})")
                tensor.copy_(value)
    if unfilled:
        raise WeightMapError(f"{len(unfilled)} Megatron parameters no {weight_map.facts.family} rule fills: {unfilled[:20]}")


def _sharded_state_dict(chunks):
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def import_hf(hf_path: str, layout: ParallelLayout, dtype: str = "fp32"):
    """(facts, weight map, chunks) of this rank's model at `layout`, weights streamed from the HF checkpoint."""
    checkpoint = HFCheckpoint(hf_path)
    facts = checkpoint.facts(layout.tp)
    weight_map = WeightMap(facts, stacked_experts=checkpoint.stacked_experts)
    init_model_parallel(layout)
    chunks = build_chunks(facts, layout, dtype)
    load_hf_weights(chunks, weight_map, checkpoint)
    checkpoint.close()
    return facts, weight_map, chunks


def save_mcore(chunks, weight_map: WeightMap, out: str, dtype: str, tokenizer_dir: Optional[str] = None,
               quantization_config: Optional[dict] = None) -> None:
    """dist_checkpointing save of the chunks plus the META_FILE that lets any layout load them; a quantised source's
    `quantization_config` is kept in it."""
    save_sharded(_sharded_state_dict(chunks), out)
    if torch.distributed.get_rank() == 0:
        facts = weight_map.facts
        meta = ConvertMeta(facts.hf, facts.padded_vocab_size, dtype, weight_map.stacked_experts, facts.num_mtp_layers,
                           quantization_config)
        meta.save(out)
        if tokenizer_dir:
            copy_tokenizer(tokenizer_dir, out)
    torch.distributed.barrier()


def save_source_scales(checkpoint: HFCheckpoint, out: str) -> None:
    """SCALES_FILE in `out`: the scales of `checkpoint`'s FP8 weights under their own names; MXFP4_SCALES_FILE: those
    of its MXFP4 experts; nothing for an unquantised checkpoint."""
    from safetensors.torch import save_file

    for file, names in ((SCALES_FILE, checkpoint.scale_keys.values()),
                        (MXFP4_SCALES_FILE, [scales for _, scales in checkpoint.mxfp4_keys.values()])):
        if names:
            save_file({key: checkpoint._slice(key)[:] for key in names}, os.path.join(out, file),
                      metadata={"format": "pt"})


def source_scales(mcore_path: str, quantisation: BlockFP8 | MXFP4):
    """key -> the scales the quantised source held for HF weight `key` (None if it held none), from the SCALES_FILE
    (FP8) or MXFP4_SCALES_FILE of a converter checkpoint; None when there is no such file, or for FP8 when the
    source's blocks are not those `quantisation` writes."""
    from safetensors import safe_open

    mxfp4 = isinstance(quantisation, MXFP4)
    path = Path(mcore_path, MXFP4_SCALES_FILE if mxfp4 else SCALES_FILE)
    if not path.is_file():
        return None
    if not mxfp4:  # MXFP4 has one kind of scale; FP8 blocks of another size have scales of no use
        original = BlockFP8.from_hf_config({"quantization_config": ConvertMeta.load(mcore_path).quantization_config})
        if (original.block, original.power_of_two_scales) != (quantisation.block, quantisation.power_of_two_scales):
            return None
    suffix = SCALES_SUFFIX if mxfp4 else SCALE_SUFFIX
    handle = safe_open(path, "pt")
    held = set(handle.keys())

    def scale_of(key: str) -> Optional[torch.Tensor]:
        name = key + suffix
        return handle.get_tensor(name) if name in held else None

    return scale_of


def load_mcore(mcore_path: str, layout: ParallelLayout, dtype: Optional[str] = None):
    """(facts, weight map, chunks) of a converter checkpoint loaded at `layout` (any TP/PP/EP)."""
    from megatron.core import dist_checkpointing

    meta = ConvertMeta.load(mcore_path)
    facts = meta.facts(layout.tp)
    init_model_parallel(layout)
    chunks = build_chunks(facts, layout, dtype or meta.dtype)
    state = dist_checkpointing.load(_sharded_state_dict(chunks), mcore_path)
    if len(chunks) == 1:
        chunks[0].load_state_dict(state)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{i}"])
    return facts, WeightMap(facts, meta.stacked_experts), chunks


def copy_tokenizer(source: str, out: str) -> None:
    for name in TOKENIZER_FILES:
        if Path(source, name).is_file():
            shutil.copy(Path(source, name), Path(out, name))


# ---- logits ---------------------------------------------------------------------------------------
def verify_tokens(vocab_size: int, batch: int = 2, seq_len: int = 16) -> torch.Tensor:
    """Fixed token ids the logit comparisons use."""
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))


def megatron_logits(chunks, facts: ModelFacts, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                    row_inputs: Optional[list[dict]] = None) -> Optional[torch.Tensor]:
    """[batch, seq, vocab] logits (TP-gathered, vocab padding stripped) on last-stage ranks, else None.
    `position_ids`: [batch, seq], or [3, batch, seq] M-RoPE positions (default: 0..seq-1); `row_inputs`: per row,
    further forward arguments (a vision-language model's pixel_values and image_grid_thw)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seq_len = tokens.shape[1]
    # One sequence per micro-batch: the interleaved (VPP) schedule needs at least PP micro-batches.
    if position_ids is None:
        position_ids = torch.arange(seq_len).expand_as(tokens)
    micro_batches = [(tokens[i:i + 1], position_ids[..., i:i + 1, :], (row_inputs or [{}] * len(tokens))[i])
                     for i in range(len(tokens))]

    def keep_logits(output):
        return torch.zeros(()), {"logits": output}

    def forward_step(data_iterator, model):
        sequence, positions, inputs = next(data_iterator)
        return model(sequence, positions, None, **inputs), keep_logits

    for chunk in chunks:
        chunk.eval()
    iterators = [iter(micro_batches) for _ in chunks]  # each virtual stage walks the micro-batches itself
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            micro_batch_size=1,
            forward_only=True,
        )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    logits = torch.cat([output["logits"] for output in outputs])  # [b, s, vocab / TP]
    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., : facts.vocab_size].float()


def hf_logits(hf_path: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the HF transformers model in `hf_path`, in fp32. A block-wise FP8 checkpoint's model holds the
    weights as HFCheckpoint dequantises them: transformers' own dequantisation on CPU takes the block size to be the
    weight's shape over the scale grid's, which partial edge blocks make wrong. An MXFP4 one's too: the values
    transformers' dequantisation gives (tests/models/test_mxfp4.py), in float32 whatever its MXFP4 loading does on
    this machine (GPU kernels, or bf16)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    checkpoint = HFCheckpoint(hf_path)
    # A vision-language wrapper (Kimi-K2.5's) has no causal-LM class; its image-text class runs text alone.
    auto = AutoModelForImageTextToText if "vision_config" in json.loads(
        (checkpoint.path / "config.json").read_text()) else AutoModelForCausalLM
    if checkpoint.fp8 is None and checkpoint.mxfp4 is None:
        model = auto.from_pretrained(hf_path, dtype=torch.float32)
    else:
        # transformers' loading regroups the HF tensors (stacked experts), so it reads the weights from files.
        with tempfile.TemporaryDirectory(prefix="rlm-dequantised-") as plain:
            _write_dequantised(checkpoint, plain)
            model = auto.from_pretrained(plain, dtype=torch.float32)
    checkpoint.close()
    with torch.no_grad():
        return model(tokens).logits.float()


def _write_dequantised(checkpoint: HFCheckpoint, out: str) -> None:
    """`checkpoint` as an unquantised HF checkpoint in `out`, a shard at a time (config.json less its
    quantization_config)."""
    from safetensors.torch import save_file

    shards: dict[str, list[str]] = {}
    for key, file in checkpoint.key_files.items():
        shards.setdefault(file, []).append(key)
    for file, keys in shards.items():
        save_file({key: checkpoint.read(Source(key)) for key in keys}, os.path.join(out, file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict(checkpoint.key_files)}
    Path(out, "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((checkpoint.path / "config.json").read_text())
    Path(out, "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    diff = (reference - candidate).abs().max()
    cosine = torch.nn.functional.cosine_similarity(reference.flatten(), candidate.flatten(), dim=0)
    return {"max_abs_diff": float(diff), "cosine": float(cosine)}


__all__ = [
    "ConversionError", "HFCheckpoint", "UnsupportedModelError", "copy_tokenizer", "import_hf", "load_mcore",
    "save_mcore", "save_source_scales", "source_scales", "megatron_logits", "hf_logits", "compare_logits",
]
