"""Flattened weight buckets: group a stream of (name, tensor) into 1-D byte buffers plus per-tensor metadata.

The layout is SGLang's multi-dtype `FlattenedTensorBucket`: every tensor is viewed as uint8 and
concatenated, so `start_idx`, `end_idx` and `numel` count bytes of the flat buffer, and a tensor is
rebuilt as `flat[start_idx:end_idx].view(dtype).reshape(shape)`. That view needs `start_idx` to be a multiple of the
dtype's size, so each tensor starts at the next such offset (a bf16 tensor of odd length before an fp32 one leaves
two bytes of padding).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence, Union

import torch

from rlmegatron.models.families import family_for

NamedTensor = tuple[str, torch.Tensor]


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int
    """Bytes, like start_idx/end_idx: the flat buffer is uint8 so one bucket can mix dtypes."""


@dataclass
class FlattenedBucket:
    flattened_tensor: torch.Tensor
    """1-D uint8."""
    metadata: list[FlattenedTensorMetadata]

    @property
    def nbytes(self) -> int:
        return self.flattened_tensor.numel()

    @property
    def names(self) -> list[str]:
        return [meta.name for meta in self.metadata]

    def named_tensors(self) -> list[NamedTensor]:
        """Views into the flat buffer, not copies."""
        return [
            (m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
            for m in self.metadata
        ]


@dataclass(frozen=True)
class TravelRule:
    """Tensors whose names match `pattern` and differ only in the `member` group travel in one bucket,
    which is flushed once every one of `members` has arrived."""

    pattern: re.Pattern[str]
    members: frozenset[str]

    def group_of(self, name: str) -> tuple[str, str] | None:
        """(what the partners share: the name with the member replaced by `*`, which partner this is)."""
        match = self.pattern.match(name)
        if match is None:
            return None
        start, end = match.span("member")
        return name[:start] + "*" + name[end:], match.group("member")


def travel_rules_for(hf_config: Any) -> tuple[TravelRule, ...]:
    """The travel rules of the tensors the model's family says an engine must receive together
    (models.families: same_bucket); `hf_config` is a transformers config or a config.json's contents."""
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    family = family_for(config.get("model_type"))
    groups = family.same_bucket(family.config(config))
    return tuple(TravelRule(re.compile(group.pattern), group.members) for group in groups)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


class Bucketer:
    """Streams (name, tensor) into buckets of at most `bucket_bytes` (a tensor or travel group larger than
    that gets a bucket of its own).

    Tensors are only referenced until their bucket is flushed, and each bucket is filled right before it
    is yielded, so extra memory is one bucket. With `reuse_buffer` every bucket is a view of one buffer
    that the next bucket overwrites: the consumer must be done with a bucket (server answered) before it
    asks for the next, which a synchronous `for` loop guarantees.
    """

    def __init__(
        self,
        bucket_bytes: int,
        travel_rules: Sequence[TravelRule] = (),
        reuse_buffer: bool = False,
        shared_memory: bool = False,
    ) -> None:
        """`shared_memory` allocates CPU buffers in shared memory, so handing a bucket to another process
        (SGLang's serializer) copies nothing; CUDA buffers travel as IPC handles either way."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.travel_rules = tuple(travel_rules)
        self.reuse_buffer = reuse_buffer
        self.shared_memory = shared_memory
        self._buffer: torch.Tensor | None = None
        self.peak_buffer_bytes = 0
        """Largest flat buffer this bucketer allocated; the benchmark reports it."""

    def buckets(self, stream: Iterable[Union[NamedTensor, FlattenedBucket]]) -> Iterator[FlattenedBucket]:
        """Buckets already flattened upstream pass through unchanged, after the pending tensors are flushed."""
        pending: list[NamedTensor] = []
        pending_bytes = 0
        waiting: dict[tuple[int, str], dict[str, NamedTensor]] = {}
        for item in stream:
            if isinstance(item, FlattenedBucket):
                if pending:
                    yield self._flatten(pending)
                    pending, pending_bytes = [], 0
                yield item
                continue
            unit = self._complete_unit(item, waiting)
            if unit is None:
                continue
            unit_bytes = sum(tensor_nbytes(t) for _, t in unit)
            if pending and pending_bytes + unit_bytes > self.bucket_bytes:
                yield self._flatten(pending)
                pending, pending_bytes = [], 0
            pending.extend(unit)
            pending_bytes += unit_bytes
        if waiting:
            missing = {f"{key}: has {sorted(parts)}" for (_, key), parts in waiting.items()}
            raise ValueError(f"weight stream ended with travel groups missing partners: {sorted(missing)}")
        if pending:
            yield self._flatten(pending)

    def _complete_unit(
        self, item: NamedTensor, waiting: dict[tuple[int, str], dict[str, NamedTensor]]
    ) -> list[NamedTensor] | None:
        name = item[0]
        for rule_index, rule in enumerate(self.travel_rules):
            group = rule.group_of(name)
            if group is None:
                continue
            key, member = group
            parts = waiting.setdefault((rule_index, key), {})
            if member in parts:
                raise ValueError(f"{name!r} appears twice in the weight stream")
            parts[member] = item
            if set(parts) != rule.members:
                return None
            del waiting[(rule_index, key)]
            return list(parts.values())
        return [item]

    def _flatten(self, named_tensors: list[NamedTensor]) -> FlattenedBucket:
        starts, end = [], 0
        for _, tensor in named_tensors:
            start = _aligned(end, tensor.element_size())
            starts.append(start)
            end = start + tensor_nbytes(tensor)
        device = named_tensors[0][1].device
        flat = self._allocate(end, device)
        metadata, destinations, sources = [], [], []
        for (name, tensor), offset in zip(named_tensors, starts):
            nbytes = tensor_nbytes(tensor)
            if nbytes:
                destinations.append(flat[offset : offset + nbytes])
                sources.append(tensor.detach().reshape(-1).view(torch.uint8))
            metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + nbytes, nbytes))
        if destinations:  # one multi-tensor copy, not a launch per tensor
            torch._foreach_copy_(destinations, sources)
        return FlattenedBucket(flat, metadata)

    def _allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, nbytes)
        if not self.reuse_buffer or nbytes > self.bucket_bytes:
            return self._empty(nbytes, device)
        if self._buffer is None or self._buffer.device != device:
            self._buffer = self._empty(self.bucket_bytes, device)
        return self._buffer[:nbytes]

    def _empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.shared_memory and device.type == "cpu":
            return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def iter_buckets(
    stream: Iterable[Union[NamedTensor, FlattenedBucket]],
    bucket_bytes: int,
    travel_rules: Sequence[TravelRule] = (),
    reuse_buffer: bool = False,
) -> Iterator[FlattenedBucket]:
    return Bucketer(bucket_bytes, travel_rules, reuse_buffer).buckets(stream)
