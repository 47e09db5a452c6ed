"""SGLang's wire formats: the flattened-bucket payload of /update_weights_from_tensor, the weight-update process group,
and the routed experts a generation returns."""
from __future__ import annotations

import base64
import copyreg
import io
import pickle
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  registers torch's tensor/storage reductions on ForkingPickler

from rlmegatron.models.families import architecture_of
from rlmegatron.rollout.buckets import FlattenedBucket, FlattenedTensorMetadata

SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"
SGLANG_METADATA_CLASS = "FlattenedTensorMetadata"


class _SGLangMetadataClass:
    """Stands for sglang's FlattenedTensorMetadata in the pickle stream, so the trainer needs no sglang install."""


class _BucketPickler(pickle._Pickler):  # type: ignore[misc]
    """ForkingPickler's reductions (CUDA tensors become IPC handles, CPU tensors shared memory) with our
    metadata written as SGLang's own dataclass, which the server's unpickler resolves and accepts.

    The pure-Python pickler is used because only it lets a class be written by name without being
    importable here; the payload is small (handles and metadata, never tensor bytes).
    """

    dispatch_table = {**copyreg.dispatch_table, **ForkingPickler._extra_reducers}

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return cuda_tensor_reduction(obj)
        if isinstance(obj, FlattenedTensorMetadata):
            # Positional in field order, which SGLang's dataclass shares.
            return _SGLangMetadataClass, (obj.name, obj.shape, obj.dtype, obj.start_idx, obj.end_idx, obj.numel)
        return NotImplemented

    def save_global(self, obj, name=None):
        if obj is _SGLangMetadataClass:
            self.save(SGLANG_METADATA_MODULE)
            self.save(SGLANG_METADATA_CLASS)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


_CUDA_DEVICE_ARG = 6  # of torch's rebuild_cuda_tensor arguments


def cuda_tensor_reduction(tensor: torch.Tensor):
    """torch's IPC reduction of a CUDA tensor with the device named by UUID instead of index.

    An index means nothing in a process that sees other GPUs (each Ray worker sees only its own as device 0),
    so SGLang patches torch's `rebuild_cuda_tensor` (sglang.srt.utils.patch_torch) to take a device UUID and
    find it among its own devices; a sender must send the UUID, as SGLang's patched reducer does.
    """
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    device = args[_CUDA_DEVICE_ARG]
    if not isinstance(device, str):  # already a UUID if this process has SGLang's patch installed
        device = str(torch.cuda.get_device_properties(device).uuid)
    return rebuild, (*args[:_CUDA_DEVICE_ARG], device, *args[_CUDA_DEVICE_ARG + 1:])


def serialize_flattened_bucket(bucket: FlattenedBucket) -> str:
    """One entry of `serialized_named_tensors` for `load_format="flattened_bucket"`: base64 of the pickled
    `{"flattened_tensor", "metadata"}` dict, as SGLang's MultiprocessingSerializer(output_str=True) makes it.

    The tensor's memory is shared, not copied: it must stay alive and unchanged until the server answered.
    """
    tensor = bucket.flattened_tensor
    if tensor.device.type == "cpu" and torch.multiprocessing.get_sharing_strategy() != "file_system":
        # The default file-descriptor strategy only reaches processes forked from this one.
        raise RuntimeError("CPU buckets reach an unrelated server process only with "
                           "torch.multiprocessing.set_sharing_strategy('file_system')")
    buffer = io.BytesIO()
    _BucketPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(
        {"flattened_tensor": tensor, "metadata": list(bucket.metadata)}
    )
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_flattened_bucket(payload: str) -> dict:
    """The server side of `serialize_flattened_bucket`, for tests and tools (SGLang has its own)."""
    return pickle.loads(base64.b64decode(payload))


def serialize_records(records: list[tuple[str, torch.Tensor]]) -> str:
    """One entry of `serialized_named_tensors` for a custom weight loader (a delta push): the named tensors with their
    bytes inside the payload, not shared (the server may be on another node), pickled as plain pickle writes CPU
    tensors, which SGLang's safe unpickler takes (a storage's bytes through `torch.load(weights_only=True)`)."""
    cpu = [(name, tensor.detach().to("cpu")) for name, tensor in records]
    return base64.b64encode(pickle.dumps(cpu, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


class _RecordsUnpickler(pickle.Unpickler):
    """What `serialize_records` writes and nothing else: torch's tensor rebuild, a storage through weights-only
    torch.load (never torch's own helper, which loads with everything allowed), dtypes and containers."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"), ("torch", "Size"), ("collections", "OrderedDict"),
               ("torch", "device"), ("builtins", "list"), ("builtins", "tuple")}

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                               torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"not a weight record: {module}.{name}")


def deserialize_records(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The server side of `serialize_records` (the local engine's server; SGLang unpickles with its own)."""
    return _RecordsUnpickler(io.BytesIO(base64.b64decode(payload))).load()


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = timedelta(minutes=10),
) -> torch.distributed.ProcessGroup:
    """A process group outside the default one, built as SGLang builds the weight-update group
    (`sglang.srt.utils.init_custom_process_group`): TCP rendezvous at `init_method`, a store prefixed with
    `group_name`, and group ranks equal to the ranks given. The trainer is rank 0; server TP rank i is
    rank_offset + i."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def on_the_wire(tensor: torch.Tensor, backend: str) -> torch.Tensor:
    """What a weight-update broadcast carries of `tensor`: gloo has no float8 types, so over gloo an FP8 weight
    (rollout.quantization fp8) travels as its bytes, viewed back on arrival by the same view; NCCL carries it as is."""
    return tensor.view(torch.uint8) if backend == "gloo" and tensor.dtype == torch.float8_e4m3fn else tensor


@dataclass(frozen=True)
class RoutedExpertsLayout:
    """SGLang's `meta_info.routed_experts` (`--enable-return-routed-experts`, request field `return_routed_experts`):
    base64 of int32 expert ids, [tokens, decoder layers, top-k], for every token the server ran (the prompt and the
    output but its last token); a dense layer's entries mean nothing. The record routing replay keeps is the MoE
    layers' only, [tokens, MoE layers, top-k] int16 (models/routing_replay.py)."""

    layers: int
    moe_layers: tuple[int, ...]
    """0-based decoder layers whose MLP is routed."""
    topk: int

    @classmethod
    def of(cls, hf_config) -> "RoutedExpertsLayout":
        """`hf_config`: a transformers config (the driver's) or a config.json's contents."""
        arch = architecture_of(hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config)
        return cls(len(arch.moe_layers), tuple(i for i, routed in enumerate(arch.moe_layers) if routed),
                   arch.num_experts_per_tok)

    def decode(self, payload: str) -> torch.Tensor:
        ids = np.frombuffer(base64.b64decode(payload), dtype=np.int32).reshape(-1, self.layers, self.topk)
        return torch.from_numpy(ids[:, list(self.moe_layers)].astype(np.int16))

    def encode(self, routed: torch.Tensor) -> str:
        """The server side, as SGLang writes it (the local engine's server): zeros in the dense layers."""
        full = torch.zeros(routed.shape[0], self.layers, self.topk, dtype=torch.int32)
        full[:, list(self.moe_layers)] = routed.to(torch.int32)
        return base64.b64encode(full.numpy().tobytes()).decode("utf-8")


@dataclass(frozen=True)
class DistributedGroupSpec:
    """Where the trainer (rank 0) and the server's TP ranks (1..tp_size) meet for broadcasts."""

    master_address: str
    master_port: int
    group_name: str = "rlmegatron_weight_sync"
    backend: str = "nccl"
