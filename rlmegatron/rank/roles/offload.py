"""Offload a worker's parameters, gradients and optimizer state to (pinned) CPU memory between phases, and back."""
from __future__ import annotations

from typing import Iterable

import torch

from rlmegatron.models.lora import base_weight_copies

PARTS = ("params", "grads", "optimizer")


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offloader:
    """Frees the device storage behind the model chunks (and optimizer) and restores it bit for bit.

    It works on storages, not tensors: Megatron's parameters and grads are views into
    contiguous DDP buffers, and the distributed optimizer's fp32 shards may view those
    buffers too. Resizing a storage to 0 frees it while every view keeps pointing at the
    storage object, so after `onload` resizes it back and copies the bytes in, all views are
    valid again without re-wiring Megatron's buffers.
    """

    def __init__(self, chunks: list, optimizer=None):
        self.chunks = chunks
        self.optimizer = optimizer
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    def _tensors(self, parts: frozenset[str]):
        for chunk in self.chunks:
            # Megatron's DDP replaces nn.Module.buffers() with its list of contiguous param/grad buffers;
            # a frozen (unwrapped) chunk has none.
            if hasattr(chunk, "module"):
                for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
                    if "params" in parts:
                        yield buffer.param_data
                    if "grads" in parts:
                        yield buffer.grad_data
            if "params" in parts:
                yield from chunk.parameters()
                yield from base_weight_copies([chunk])  # LoRA's base weights of the modules it trains whole
            if "grads" in parts:
                for param in chunk.parameters():
                    if getattr(param, "main_grad", None) is not None:
                        yield param.main_grad
        if self.optimizer is not None and "optimizer" in parts:
            for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                inner = getattr(optimizer, "optimizer", None)
                if inner is None:
                    continue
                for group in inner.param_groups:
                    yield from group["params"]
                for state in inner.state.values():
                    yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

    def offload(self, parts: Iterable[str] = PARTS) -> None:
        """`parts`: any of params, grads, optimizer; a storage that an offloaded part shares goes with it
        (with fp32 weights the distributed optimizer's main params are views of the param buffers)."""
        if self._saved:
            raise RuntimeError("already offloaded")
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown offload parts {sorted(unknown)}; known: {list(PARTS)}")
        seen = set()
        for tensor in self._tensors(frozenset(parts)):
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_byte_view(storage), non_blocking=True)
            self._saved.append((storage, host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for storage, _ in self._saved:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        for storage, host in self._saved:
            storage.resize_(host.numel())
            _byte_view(storage).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._saved = []

    @property
    def offloaded_bytes(self) -> int:
        return sum(host.numel() for _, host in self._saved)
