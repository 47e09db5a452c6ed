"""Delta weight sync (`rollout.weight_sync: delta`): after the first full push, each push carries, per tensor, only
the elements whose bits in the engine's dtype differ from what the engine already holds.

Both ends keep the last weights that went across, in the engine's dtype, on the CPU: the sender (`DeltaSender`) to
know what changed, the engine side (`DeltaReceiver`) to rebuild each changed tensor whole before it loads it, since an
engine's loaders take whole HF tensors (SGLang fuses and shards them on the way in). Rebuilding from the bits that
went across is exact: after every push the engine holds, bit for bit, what a full push would have given it. The
engine loads only the tensors that changed, each with the partners it must load together (a travel group, an FP8
weight and its scale).

A push is a stream of records, HF-named tensors on the wire (`#` never appears in an HF name):

    name              the whole tensor (a full push, or a delta that would not be smaller)
    name#idx name#val the flat positions that changed (int32, int64 past 2**31 elements) and their new values
    name#mask name#val a bitmask of the positions that changed (1 bit per element, little-endian bits) and values
    name#same         unchanged, sent because a partner changed (an empty uint8 tensor)

A record of an FP8 tensor travels as its bytes, `name@float8_e4m3fn` in uint8: torch's weights-only loader, through
which SGLang unpickles a tensor sent by value, cannot rebuild an FP8 storage.

Each tensor takes the smallest of whole, indices and bitmask (`encoding="auto"`): indices cost 4 + s bytes per changed
element of s bytes, the bitmask n / 8 bytes plus s per change; the bitmask wins once more than 1 element in 32 changes
(benchmarks/RESULTS.md, "Delta weight sync"). Bits are compared as integers, so NaN, -0.0 and FP8's bytes and scales
are exact too.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Sequence

import torch

from rlmegatron.models.fp8 import FP8, SCALE_SUFFIX
from rlmegatron.rollout.buckets import NamedTensor, TravelRule

Encoding = Literal["auto", "indices", "bitmask"]
INDICES, MASK, VALUES, SAME = "#idx", "#mask", "#val", "#same"
LOADER = "rlmegatron.rollout.delta.load_delta"
"""The import path SGLang takes as a custom weight loader (`--custom-weight-loader`, then `load_format` of
`/update_weights_from_tensor`): the engine side of a delta push in SGLang's scheduler processes."""
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS = torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their size, flat: equal exactly when their bits are."""
    return tensor.detach().reshape(-1).view(_INT_VIEW[tensor.element_size()])


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8)
    padded[:mask.numel()] = mask
    return (padded.view(-1, 8) * _BITS).sum(dim=1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return (packed.unsqueeze(1) & _BITS).ne(0).reshape(-1)[:numel]


_BY_BYTES = {dtype: str(dtype).removeprefix("torch.") for dtype in
             (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}
_DTYPES = {name: dtype for dtype, name in _BY_BYTES.items()}


def _as_bytes(record: NamedTensor) -> NamedTensor:
    name, tensor = record
    if tensor.dtype in _BY_BYTES:
        return f"{name}@{_BY_BYTES[tensor.dtype]}", tensor.view(torch.uint8)
    return record


def _from_bytes(record: NamedTensor) -> NamedTensor:
    name, tensor = record
    base, at, dtype = name.rpartition("@")
    return (base, tensor.view(_DTYPES[dtype])) if at and dtype in _DTYPES else record


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def encode(name: str, new: torch.Tensor, old: torch.Tensor | None, encoding: Encoding = "auto") -> list[NamedTensor]:
    """The records that take a holder of `old` to `new` (both CPU): [] when nothing changed."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return [(name, new)]
    changed = bits(new) != bits(old)
    count = int(changed.sum())
    if count == 0:
        return []
    size, numel = new.element_size(), new.numel()
    costs = {"indices": count * (8 if numel >= 2 ** 31 else 4) + count * size,
             "bitmask": math.ceil(numel / 8) + count * size}
    chosen = min(costs, key=costs.get) if encoding == "auto" else encoding
    if encoding == "auto" and costs[chosen] >= numel * size:
        return [(name, new)]
    values = new.reshape(-1)[changed]
    if chosen == "indices":
        positions = changed.nonzero().reshape(-1)
        return [(name + INDICES, positions if numel >= 2 ** 31 else positions.to(torch.int32)), (name + VALUES, values)]
    return [(name + MASK, pack_mask(changed)), (name + VALUES, values)]


@dataclass
class SyncBytes:
    """What one push carried, against what a full push of the same tensors would have."""

    sent: int = 0
    full: int = 0
    tensors_changed: int = 0
    tensors: int = 0

    def add(self, other: "SyncBytes") -> None:
        self.sent += other.sent
        self.full += other.full
        self.tensors_changed += other.tensors_changed
        self.tensors += other.tensors


def load_groups(travel_rules: Sequence[TravelRule], scale_suffix: str | None) -> Callable[[str], list[tuple]]:
    """`groups(name)`: the groups the engine must load `name` with the rest of: one per travel rule it matches (what
    its members share) and, with FP8 (`scale_suffix`), the weight's name, shared by the weight and its scale."""
    def groups(name: str) -> list[tuple]:
        keys: list[tuple] = [(index, group[0]) for index, rule in enumerate(travel_rules)
                             if (group := rule.group_of(name)) is not None]
        if scale_suffix is not None:
            keys.append(("fp8", name.removesuffix(scale_suffix)))
        return keys
    return groups


def _no_groups(name: str) -> list[tuple]:
    return []


class DeltaSender:
    """The trainer side: the last weights sent (CPU, the engine's dtype), and the records that bring an engine that
    holds them to the weights now."""

    def __init__(self, groups: Callable[[str], list[tuple]] = _no_groups, encoding: Encoding = "auto") -> None:
        self.groups, self.encoding = groups, encoding
        self.last: dict[str, torch.Tensor] = {}

    @property
    def copy_bytes(self) -> int:
        """The memory the last-sent copy takes."""
        return sum(nbytes(tensor) for tensor in self.last.values())

    def records(self, named_tensors: Sequence[NamedTensor], full: bool) -> tuple[list[NamedTensor], SyncBytes]:
        """The records of one group of tensors that travel together (a bucket), each whole when `full`; the copy
        becomes these tensors."""
        counted = SyncBytes(tensors=len(named_tensors))
        cpu = [(name, tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format))
               for name, tensor in named_tensors]
        encoded = {name: [(name, tensor)] if full else encode(name, tensor, self.last.get(name), self.encoding)
                   for name, tensor in cpu}
        names = [name for name, _ in cpu]
        keys = {name: self.groups(name) for name in names}
        members: dict[tuple, list[str]] = {}
        for name in names:
            for key in keys[name]:
                members.setdefault(key, []).append(name)
        for name in [name for name in names if encoded[name]]:
            for partner in (partner for key in keys[name] for partner in members[key]):
                if not encoded[partner]:
                    encoded[partner] = [(partner + SAME, torch.empty(0, dtype=torch.uint8))]
        out = [_as_bytes(record) for name in names for record in encoded[name]]
        for name, tensor in cpu:
            self.last[name] = tensor
            counted.full += nbytes(tensor)
        counted.sent = sum(nbytes(tensor) for _, tensor in out)
        counted.tensors_changed = sum(1 for name in names if encoded[name] and not encoded[name][0][0].endswith(SAME))
        return out, counted


class DeltaReceiver:
    """The engine side: the last weights received (CPU), and the whole tensors a group of records makes."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}

    def apply(self, records: Iterable[NamedTensor]) -> list[NamedTensor]:
        """The whole tensors to load, in the records' order: the changed ones and their partners."""
        records = [_from_bytes(record) for record in records]
        by_name = dict(records)
        out: list[NamedTensor] = []
        for name, tensor in records:
            if name.endswith(SAME):
                base = name[:-len(SAME)]
            elif name.endswith(INDICES) or name.endswith(MASK):
                base = name[:-len(INDICES if name.endswith(INDICES) else MASK)]
                held = self._held(base)
                flat = bits(held)
                values = bits(by_name[base + VALUES].to("cpu"))
                if name.endswith(INDICES):
                    flat[tensor.to("cpu", torch.int64)] = values
                else:
                    flat[unpack_mask(tensor.to("cpu"), flat.numel())] = values
            elif name.endswith(VALUES):
                continue
            else:
                base = name
                self.held[base] = tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            out.append((base, self._held(base)))
        return out

    def _held(self, name: str) -> torch.Tensor:
        try:
            return self.held[name]
        except KeyError:
            raise KeyError(f"a delta for {name}, which this engine has not received whole yet") from None


_RECEIVERS: "dict[int, tuple[object, DeltaReceiver]]" = {}


def load_delta(model, named_tensors: list[NamedTensor]) -> None:
    """SGLang's custom weight loader (`LOADER`): the whole tensors the records make, loaded by the model's own
    `load_weights`. One receiver per model object, in each scheduler process (each TP rank keeps its copy)."""
    key = id(model)
    if key not in _RECEIVERS or _RECEIVERS[key][0] is not model:
        _RECEIVERS[key] = (model, DeltaReceiver())
    model.load_weights(_RECEIVERS[key][1].apply(named_tensors))


def iter_records(buckets: Iterable, sender: DeltaSender, full: bool,
                 counted: SyncBytes) -> Iterator[list[NamedTensor]]:
    """Each bucket of whole tensors (`FlattenedBucket`s) as its records, counted into `counted`."""
    for bucket in buckets:
        records, bucket_bytes = sender.records(bucket.named_tensors(), full)
        counted.add(bucket_bytes)
        yield records


def digest(tensor: torch.Tensor) -> str:
    """A checksum of the tensor's bits (trainer.check_sync_every)."""
    return hashlib.blake2b(bits(tensor.detach().to("cpu").contiguous()).numpy().tobytes(), digest_size=8).hexdigest()


def expected_digests(stream: Iterable[NamedTensor], weight_format, dtype: torch.dtype) -> dict[str, str]:
    """The checksum of each weight an engine of `dtype` holds after a full push of `stream`: an FP8 weight
    dequantised with its scale (`weight_format`, as the local engine does), every weight cast to `dtype`."""
    out, halves = {}, {}
    for name, tensor in stream:
        if weight_format is not None and (tensor.dtype == FP8 or name.endswith(SCALE_SUFFIX)):
            weight_name = name.removesuffix(SCALE_SUFFIX)
            if weight_name not in halves:
                halves[weight_name] = tensor
                continue
            other = halves.pop(weight_name)
            weight, scale = (other, tensor) if name.endswith(SCALE_SUFFIX) else (tensor, other)
            name, tensor = weight_name, weight_format.dequantise(weight, scale)
        out[name] = digest(tensor.to(dtype))
    return out
