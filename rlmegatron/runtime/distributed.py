"""Process-group and model-parallel setup: cuda + nccl on GPUs, cpu + gloo (with the CPU layer) otherwise."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Literal, Optional

import torch

Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron parallel sizes of one model; data parallelism is whatever the world size leaves."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # None: experts use the dense TP size
    sequence_parallel: bool = False
    # Uneven pipeline: decoder layers on the first/last stage, the rest split evenly (None: even split).
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    def transformer_config_fields(self) -> dict:
        """The TransformerConfig fields that carry this layout."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            sequence_parallel=self.sequence_parallel,
            num_layers_in_first_pipeline_stage=self.first_stage_layers,
            num_layers_in_last_pipeline_stage=self.last_stage_layers,
        )

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.first_stage_layers or self.last_stage_layers:
            parts[-1] += f"({self.first_stage_layers or '-'},{self.last_stage_layers or '-'})"
        parts += [f"VPP{self.vpp}"] if self.vpp else []
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        parts += [f"ETP{self.etp}"] if self.etp else []
        parts += ["SP"] if self.sequence_parallel else []
        return "x".join(parts)


def transformer_config_overrides(device: Device) -> dict:
    """TransformerConfig fields the process-group backend dictates."""
    if device == "cpu":
        # gloo pairs sends and receives to one peer in posting order, so batched p2p can
        # swap the interleaved (VPP) schedule's activation and gradient: same shape, and
        # at PP=2 the same peer. Megatron's unbatched path orders them by rank parity.
        return {"batch_p2p_comm": False}
    return {}


def init_distributed(device: Device, timeout_s: float = 600.0) -> None:
    """Join the default process group from torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    if device == "cpu":
        from rlmegatron.runtime.cpu_compat import enable_cpu_compat

        enable_cpu_compat()
        backend = "gloo"
    elif device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


_megatron_groups: list = []
"""The process groups the last initialize_model_parallel created, destroyed when the layout is rebuilt."""


def init_model_parallel(layout: ParallelLayout, seed: int = 1234) -> None:
    """(Re)build Megatron's parallel groups for `layout` and seed its RNG streams. Collective.

    Megatron's destroy_model_parallel only forgets its groups; each gloo group keeps three threads and its
    sockets, so a process that changes layout thirty times (the conversion matrix) ran ~2,000 threads per rank.
    Rebuilding therefore destroys the previous layout's groups: models built under it are unusable after."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from torch.distributed.distributed_c10d import _world

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for group in _megatron_groups:
        if group in _world.pg_map:  # Megatron destroys its gloo data-parallel groups itself
            torch.distributed.destroy_process_group(group)
    _megatron_groups.clear()
    existing = set(_world.pg_map)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    _megatron_groups.extend(group for group in _world.pg_map if group not in existing)
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _megatron_groups.clear()  # destroyed with everything else just below
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
