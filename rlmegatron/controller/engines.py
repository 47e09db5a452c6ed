"""Where rollouts are generated, as the trainer sees it.

Colocated: the trainer ranks host the engines, an in-process one per rank (`rollout.engine=local`) or one SGLang
server per `rollout.tensor_parallel_size` ranks, led by the group's first rank; weights move through shared memory
or CUDA IPC. Disaggregated: SGLang servers on their own pool, each supervised by an `EngineHost`; trainer rank 0
broadcasts the weights to them over NCCL (gloo on CPU).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, RolloutEngine
from rlmegatron.tracking.progress import Progress

if TYPE_CHECKING:
    from rlmegatron.config import JobSpec


def generate_or_none(engine: RolloutEngine, requests: list[GenerationRequest],
                     progress: Progress = None) -> Optional[list[GenerationResult]]:
    """None: the engine was restarted mid-call and needs the weights before the requests are sent again."""
    from rlmegatron.rollout.sglang import EngineRestarted

    if not requests:
        return []
    try:
        return engine.generate(requests, progress)
    except EngineRestarted:
        return None


# --- inside a trainer rank (colocated) ---------------------------------------------------------------------------


def build_colocated_engine(spec: JobSpec, hf_config) -> Optional[RolloutEngine]:
    """Collective over the trainer ranks; returns None on ranks that do not lead an engine."""
    if spec.rollout.engine == "local":
        return _local_engine(spec, hf_config)
    tp = spec.rollout.tensor_parallel_size
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # Every rank reports where it runs, so a leader knows the devices of the ranks its server spans.
    places: list = [None] * world
    torch.distributed.all_gather_object(places, (socket.gethostname(), device_id(spec.placement.device)))
    if rank % tp or rank // tp >= (spec.rollout.num_gpus or world) // tp:
        return None
    group = places[rank : rank + tp]
    if len({host for host, _ in group}) > 1:
        raise RuntimeError(f"the engine of ranks {rank}..{rank + tp - 1} would span nodes {group}")
    return sglang_engine(spec, hf_config, [device for _, device in group], host="127.0.0.1")


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


def sglang_engine(spec: JobSpec, hf_config, devices: Sequence[str], host: str) -> RolloutEngine:
    """A supervised SGLang server on `devices` of this node, serving HTTP on `host`."""
    from rlmegatron.rollout.buckets import travel_rules_for
    from rlmegatron.rollout.sglang import SGLangEngine
    from rlmegatron.rollout.sglang_server import ServerSpec
    from rlmegatron.runtime.launcher import free_port

    env = {}
    if spec.placement.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    else:
        # CPU buckets reach the unrelated server process through named shared memory, not fd passing.
        torch.multiprocessing.set_sharing_strategy("file_system")
    server = ServerSpec.from_rollout_config(spec.rollout, spec.model.path, port=free_port(host), host=host,
                                            device=spec.placement.device, env=env)
    return SGLangEngine(
        server,
        log_dir=str(Path(spec.trainer.run_dir) / "logs"),
        bucket_bytes=spec.rollout.update_weights_bucket_mb << 20,
        travel_rules=travel_rules_for(hf_config),
        startup_timeout_s=spec.rollout.sglang.startup_timeout_s,
    )


def device_id(device: str) -> str:
    """This process's physical device: Ray narrows CUDA_VISIBLE_DEVICES to its GPU, torchrun sets LOCAL_RANK."""
    if device != "cuda":
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[torch.cuda.current_device()]
    return str(torch.cuda.current_device())


class ColocatedEngines:
    """The engines inside the trainer ranks: generation goes to the ranks that lead one."""

    def __init__(self, workers) -> None:
        self.workers = workers
        self.ranks = [rank for rank, serves in enumerate(workers.execute_all("serves_rollout")) if serves]

    @property
    def count(self) -> int:
        return len(self.ranks)

    def generate(self, shares: dict[int, list[GenerationRequest]],
                 progress: Progress = None) -> dict[int, Optional[list[GenerationResult]]]:
        per_rank = [([],)] * self.workers.world_size
        for engine, share in shares.items():
            per_rank[self.ranks[engine]] = (share, progress)
        replies = self.workers.execute_each("generate", per_rank)
        return {engine: replies[self.ranks[engine]] for engine in shares}

    def release_memory(self) -> None:
        self.workers.execute_all("release_rollout_memory")

    def sync(self, version: str, restarted: Optional[list[int]] = None) -> None:
        self.workers.execute_all("sync_weights", version, restarted)

    def shutdown(self) -> None:
        """The ranks stop their engines when the worker group shuts down."""


# --- on the rollout pool (disaggregated) -------------------------------------------------------------------------


class EngineHost:
    """One GPU of the rollout pool (one CPU rank on CPU). The first host of each `tensor_parallel_size`
    consecutive ones launches and supervises the server on their devices; the others hold their GPU for it."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.engine: Optional[RolloutEngine] = None

    def device(self) -> str:
        return device_id(self.spec.placement.device)

    def launch(self, devices: list[str]) -> str:
        from transformers import AutoConfig

        host = socket.gethostbyname(socket.gethostname())
        self.engine = sglang_engine(self.spec, AutoConfig.from_pretrained(self.spec.model.path), devices, host)
        return self.engine.spec.url

    def generate(self, requests: list[GenerationRequest], progress: Progress = None) -> Optional[list[GenerationResult]]:
        return generate_or_none(self.engine, requests, progress)

    def weights_pushed(self, version: str) -> None:
        """The trainer broadcast `version` to this server, around the engine, over its weight-update group."""
        self.engine.weight_version = version
        self.engine.stale = False

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


class DisaggregatedEngines:
    """The servers of the rollout pool: their hosts are Ray actors on `pool`, or live in this process without Ray."""

    def __init__(self, spec: JobSpec, workers, pool=None) -> None:
        self.workers, self.tp_size = workers, spec.rollout.tensor_parallel_size
        size = spec.rollout.num_gpus or spec.placement.rollout_pool_size
        self.hosts = _ray_hosts(spec, pool, size) if pool is not None else [EngineHost(spec) for _ in range(size)]
        devices = self._call(self.hosts, "device", [()] * size)
        self.leaders = self.hosts[:: self.tp_size]
        self.urls = self._call(self.leaders, "launch", [(devices[i : i + self.tp_size],)
                                                        for i in range(0, size, self.tp_size)])
        self.connect(list(range(self.count)))
        self.sync("init")

    @property
    def count(self) -> int:
        return len(self.leaders)

    def connect(self, engines: list[int]) -> None:
        """Trainer rank 0 joins a fresh weight-update group with each of `engines`."""
        self.workers.execute_all("connect_engines", [(e, self.urls[e], self.tp_size) for e in engines])

    def generate(self, shares: dict[int, list[GenerationRequest]],
                 progress: Progress = None) -> dict[int, Optional[list[GenerationResult]]]:
        replies = self._call([self.leaders[e] for e in shares], "generate",
                             [(share, progress) for share in shares.values()])
        return dict(zip(shares, replies))

    def release_memory(self) -> None:
        """Disaggregated servers keep their memory: nothing else runs on their GPUs."""

    def sync(self, version: str, restarted: Optional[list[int]] = None) -> None:
        if restarted is not None:
            self.connect(restarted)  # a restarted server left its old group
        self.workers.execute_all("sync_weights", version, restarted)
        targets = list(range(self.count)) if restarted is None else restarted
        self._call([self.leaders[e] for e in targets], "weights_pushed", [(version,)] * len(targets))

    def shutdown(self) -> None:
        self._call(self.hosts, "shutdown", [()] * len(self.hosts))

    @staticmethod
    def _call(hosts: list, method: str, per_host_args: list[tuple]) -> list[Any]:
        if hosts and isinstance(hosts[0], EngineHost):
            return [getattr(host, method)(*args) for host, args in zip(hosts, per_host_args)]
        import ray

        return ray.get([getattr(host, method).remote(*args) for host, args in zip(hosts, per_host_args)])


def _ray_hosts(spec: JobSpec, pool, size: int) -> list:
    """One host actor per bundle of the rollout pool, in the pool's node-sorted order."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host_class = ray.remote(EngineHost)
    resources = {"num_gpus": 1, "num_cpus": 1} if pool.device == "cuda" else {"num_cpus": 1}
    return [
        host_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pool.placement_group, pool.bundle_order[index]), **resources).remote(spec)
        for index in range(size)
    ]
