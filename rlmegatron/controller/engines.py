"""The rollout engine a colocated trainer rank hosts: an in-process engine on every rank (`rollout.engine=local`),
or one SGLang server per `rollout.tensor_parallel_size` ranks, launched and owned by the first rank of the group."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from rlmegatron.rollout.engine import RolloutEngine

if TYPE_CHECKING:
    from rlmegatron.config import JobSpec


def build_colocated_engine(spec: JobSpec, hf_config) -> Optional[RolloutEngine]:
    """Collective over the trainer ranks; returns None on ranks that do not lead an engine."""
    if spec.rollout.engine == "local":
        return _local_engine(spec, hf_config)
    return _sglang_engine(spec, hf_config)


def _local_engine(spec: JobSpec, hf_config) -> RolloutEngine:
    from transformers import AutoModelForCausalLM

    from rlmegatron.rollout.local import LocalEngine

    device = "cuda" if spec.placement.device == "cuda" else "cpu"
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).to(device)
    eos = hf_config.eos_token_id
    return LocalEngine(
        model,
        pad_token_id=hf_config.pad_token_id or 0,
        eos_token_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [],
        seed=spec.rollout.seed + torch.distributed.get_rank(),
    )


def _sglang_engine(spec: JobSpec, hf_config) -> Optional[RolloutEngine]:
    from rlmegatron.rollout.buckets import travel_rules_for
    from rlmegatron.rollout.sglang import SGLangEngine
    from rlmegatron.rollout.sglang_server import ServerSpec
    from rlmegatron.runtime.launcher import free_port

    rollout, tp = spec.rollout, spec.rollout.tensor_parallel_size
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # Every rank reports where it runs, so a leader knows the devices of the ranks its server spans.
    places: list = [None] * world
    torch.distributed.all_gather_object(places, (socket.gethostname(), _device_id(spec.placement.device)))
    engines = (rollout.num_gpus or world) // tp
    if rank % tp or rank // tp >= engines:
        return None
    group = places[rank : rank + tp]
    if len({host for host, _ in group}) > 1:
        raise RuntimeError(f"colocated engine of ranks {rank}..{rank + tp - 1} spans nodes {group}: "
                           "rollout.tensor_parallel_size must not exceed placement.gpus_per_node when colocated")
    env = {}
    if spec.placement.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(device for _, device in group)
    else:
        # CPU buckets reach the unrelated server process through named shared memory, not fd passing.
        torch.multiprocessing.set_sharing_strategy("file_system")
    server = ServerSpec.from_rollout_config(rollout, spec.model.path, port=free_port(), device=spec.placement.device,
                                            env=env)
    return SGLangEngine(
        server,
        log_dir=str(Path(spec.trainer.run_dir) / "logs"),
        bucket_bytes=rollout.update_weights_bucket_mb << 20,
        travel_rules=travel_rules_for(hf_config),
        startup_timeout_s=rollout.sglang.startup_timeout_s,
    )


def _device_id(device: str) -> str:
    """This rank's physical device: Ray narrows CUDA_VISIBLE_DEVICES to the rank's GPU, torchrun sets LOCAL_RANK."""
    if device != "cuda":
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[torch.cuda.current_device()]
    return str(torch.cuda.current_device())
