"""Where rollouts are generated, as the trainer sees it.

Colocated: the trainer ranks host the engines, an in-process one per rank (`rollout.engine=local`) or one SGLang
server per `rollout.tensor_parallel_size` ranks, led by the group's first rank; weights move through shared memory
or CUDA IPC. Disaggregated: SGLang servers on their own pool, each supervised by an `EngineHost`; trainer rank 0
broadcasts the weights to them over NCCL (gloo on CPU).
"""
from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from rlmegatron.controller.role_settings import RolloutSettings, rollout_settings
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


# --- where servers sit -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """One slot that can hold a server TP rank: a trainer rank (colocated) or a rollout-pool GPU (disaggregated)."""

    node: str
    device: str
    address: str
    rendezvous_port: int
    """Free on this node; the server's node 0 uses it as SGLang's dist-init address when it spans nodes."""


def this_place(device: str) -> Place:
    from rlmegatron.runtime.launcher import free_port

    return Place(socket.gethostname(), device_id(device), socket.gethostbyname(socket.gethostname()), free_port(""))


@dataclass(frozen=True)
class ServerNode:
    """One node's share of engine `engine`: `slots` (indices of places, in server TP order) of which the first
    launches this node's server process; `node_rank` 0 serves HTTP."""

    engine: int
    node_rank: int
    nnodes: int
    slots: tuple[int, ...]
    dist_init_addr: Optional[str]


def server_nodes(places: Sequence[Place], tp: int, engines: int) -> list[list[ServerNode]]:
    """Engine e takes slots e*tp .. e*tp+tp-1. SGLang splits a server's TP ranks evenly over whole nodes, so
    an engine's slots must form equal runs on distinct nodes."""
    layout = []
    for engine in range(engines):
        slots = range(engine * tp, (engine + 1) * tp)
        runs: list[list[int]] = []
        for slot in slots:
            if runs and places[runs[-1][0]].node == places[slot].node:
                runs[-1].append(slot)
            else:
                runs.append([slot])
        nodes = [places[run[0]].node for run in runs]
        if len(set(nodes)) != len(runs) or len({len(run) for run in runs}) != 1:
            raise RuntimeError(f"engine {engine} would take {[len(run) for run in runs]} GPUs on nodes {nodes}; "
                               "a server spans whole nodes with the same number of GPUs on each")
        head = places[runs[0][0]]
        address = f"{head.address}:{head.rendezvous_port}" if len(runs) > 1 else None
        layout.append([ServerNode(engine, rank, len(runs), tuple(run), address) for rank, run in enumerate(runs)])
    return layout


# --- inside a trainer rank (colocated) ---------------------------------------------------------------------------


class EngineMember:
    """A trainer rank in a colocated engine's group other than its leader: shares its copy of each weight bucket
    with the leader (`share_buckets`) and, if it is the first rank on a later node of a server that spans nodes,
    runs that node's server process."""

    def __init__(self, settings: RolloutSettings, group, travel_rules, node_process=None) -> None:
        self.bucket_bytes = settings.bucket_bytes
        self.tp_size, self.group, self.node_process = settings.tensor_parallel_size, group, node_process
        self.travel_rules = travel_rules
        if node_process is not None:
            node_process.start()

    def update_weights(self, named_tensors, version: str) -> None:
        from rlmegatron.rollout.sglang import share_buckets

        share_buckets(named_tensors, self.bucket_bytes, self.travel_rules, self.tp_size, self.group, post=None)

    wake_up_with_weights = update_weights

    def release_memory(self) -> None:
        """The leader releases the server's memory on every node."""

    def relaunch(self) -> None:
        """The server restarted: this node's process goes down with it and starts again."""
        if self.node_process is not None:
            self.node_process.stop()
            self.node_process.start()

    def shutdown(self) -> None:
        if self.node_process is not None:
            self.node_process.stop()


def build_colocated_engine(settings: RolloutSettings, hf_config) -> tuple[Optional[int], Any]:
    """Collective over the trainer ranks. Returns (engine index, engine) for the rank leading an engine,
    (engine index, EngineMember) for the other ranks of its group, (None, None) for ranks outside every group."""
    if settings.engine == "local":
        return torch.distributed.get_rank(), _local_engine(settings, hf_config)
    from rlmegatron.rollout.buckets import travel_rules_for
    from rlmegatron.rollout.sglang_server import launch_node

    tp = settings.tensor_parallel_size
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    places: list = [None] * world
    torch.distributed.all_gather_object(places, this_place(settings.device))
    layout = server_nodes(places, tp, (settings.num_gpus or world) // tp)
    # Every rank creates every group, in the same order, as new_group requires.
    groups = [torch.distributed.new_group([s for node in nodes for s in node.slots], backend="gloo")
              for nodes in layout] if tp > 1 else [None] * len(layout)
    mine = next(((node, index) for nodes in layout for node in nodes
                 for index, slot in enumerate(node.slots) if slot == rank), None)
    if mine is None:
        return None, None
    node, index = mine
    # Behind a router (on the driver's node) a server must be reachable from there, not just from this node.
    host = places[rank].address if settings.router_url else "127.0.0.1"
    server = _server_spec(settings, [places[slot].device for slot in node.slots], host, node)
    if node.node_rank == 0 and index == 0:
        return node.engine, sglang_engine(settings, server, hf_config, ipc_group=groups[node.engine])
    return node.engine, EngineMember(settings, groups[node.engine], travel_rules_for(hf_config),
                                     launch_node(server, settings.log_dir, start=False) if index == 0 else None)


def _local_engine(settings: RolloutSettings, hf_config) -> RolloutEngine:
    from transformers import AutoModelForCausalLM

    from rlmegatron.models.hf_config import DTYPES
    from rlmegatron.rollout.local import LocalEngine

    device = "cuda" if settings.device == "cuda" else "cpu"
    # The engine samples from the weights the trainer holds, in the trainer's dtype. No engine seed: every request
    # the trainer sends carries its own (Trainer.sampling_seed).
    model = AutoModelForCausalLM.from_config(hf_config, dtype=DTYPES[settings.model.dtype],
                                             trust_remote_code=settings.model.trust_remote_code).to(device)
    eos = hf_config.eos_token_id
    return LocalEngine(
        model,
        pad_token_id=hf_config.pad_token_id or 0,
        eos_token_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [],
    )


def _server_spec(settings: RolloutSettings, devices: Sequence[str], host: str, node: ServerNode):
    """The launch spec of `node`'s share of a server on `devices` of that node, serving HTTP on `host`."""
    from rlmegatron.runtime.launcher import free_port

    env = {}
    if settings.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    else:
        # CPU buckets reach the unrelated server process through named shared memory, not fd passing.
        torch.multiprocessing.set_sharing_strategy("file_system")
    return dataclasses.replace(settings.server, port=free_port(host), host=host, env=env, nnodes=node.nnodes,
                               node_rank=node.node_rank, dist_init_addr=node.dist_init_addr)


def sglang_engine(settings: RolloutSettings, server, hf_config, ipc_group=None) -> RolloutEngine:
    """A supervised SGLang server: node 0 of `server`, launched here and waited on."""
    from rlmegatron.rollout.buckets import travel_rules_for
    from rlmegatron.rollout.sglang import SGLangEngine

    return SGLangEngine(
        server,
        log_dir=settings.log_dir,
        bucket_bytes=settings.bucket_bytes,
        travel_rules=travel_rules_for(hf_config),
        router_url=settings.router_url,
        startup_timeout_s=settings.startup_timeout_s,
        ipc_group=ipc_group,
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


# --- in front of the servers ----------------------------------------------------------------------------------------


def start_router(spec: JobSpec):
    """`rollout.sglang.router`: an sglang_router on this (the driver's) node, healthy, with no workers yet; the
    servers join it once they hold trained weights. Returns the spec naming it in rollout.sglang.router_url,
    and its process."""
    from rlmegatron.rollout.sglang import SGLangClient
    from rlmegatron.rollout.sglang_server import ServerProcess, router_command
    from rlmegatron.runtime.launcher import free_port

    sglang = spec.rollout.sglang
    host = socket.gethostbyname(socket.gethostname())
    port = free_port(host)
    process = ServerProcess(router_command(sglang.python, [], port, host, sglang.router_args),
                            Path(rollout_settings(spec).log_dir) / "sglang_router.log")
    process.start()
    url = f"http://{host}:{port}"
    try:
        process.wait_ready(SGLangClient(url).health, sglang.startup_timeout_s)
    except BaseException:
        process.stop()
        raise
    rollout = spec.rollout.model_copy(update={"sglang": sglang.model_copy(update={"router_url": url})})
    return spec.model_copy(update={"rollout": rollout}), process


# --- on the rollout pool (disaggregated) -------------------------------------------------------------------------


class EngineHost:
    """One GPU of the rollout pool (one CPU rank on CPU). The first host of each node of a server launches that
    node's process on the node's devices; the host of node 0 supervises the server. The others hold their GPU."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.engine: Optional[RolloutEngine] = None
        self.node_process = None

    def place(self) -> Place:
        return this_place(self.settings.device)

    def launch(self, devices: list[str], node: ServerNode) -> Optional[str]:
        """Returns the server's URL on node 0's host; None on the other nodes' hosts."""
        from rlmegatron.rollout.sglang_server import launch_node

        server = _server_spec(self.settings, devices, socket.gethostbyname(socket.gethostname()), node)
        if node.node_rank:
            self.node_process = launch_node(server, self.settings.log_dir)
            return None
        self.engine = sglang_engine(self.settings, server, self.settings.model.hf_config())
        return self.engine.spec.url

    def relaunch(self) -> None:
        """The server restarted after a failure: other nodes restart their process, node 0 waits for all of them."""
        if self.node_process is not None:
            self.node_process.stop()
            self.node_process.start()
        else:
            self.engine.relaunch()

    def generate(self, requests: list[GenerationRequest], progress: Progress = None) -> Optional[list[GenerationResult]]:
        return generate_or_none(self.engine, requests, progress)

    def weights_pushed(self, version: str) -> None:
        """The trainer broadcast `version` to this server, around the engine, over its weight-update group."""
        self.engine.mark_synced(version)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self.node_process is not None:
            self.node_process.stop()


class DisaggregatedEngines:
    """The servers of the rollout pool: their hosts are Ray actors on `pool`, or live in this process without Ray."""

    def __init__(self, settings: RolloutSettings, workers, pool=None) -> None:
        self.workers, self.tp_size = workers, settings.tensor_parallel_size
        size = settings.pool_size
        self.hosts = _ray_hosts(settings, pool, size) if pool is not None else [EngineHost(settings) for _ in range(size)]
        places = self._call(self.hosts, "place", [()] * size)
        layout = server_nodes(places, self.tp_size, size // self.tp_size)
        # Per engine: the launching host of each node, node 0's (the leader) last, so a caller without Ray
        # has started the other nodes before the leader waits for the whole server.
        self.node_hosts = [[self.hosts[node.slots[0]] for node in nodes[1:] + nodes[:1]] for nodes in layout]
        self.leaders = [hosts[-1] for hosts in self.node_hosts]
        launchers = [(node, self.hosts[node.slots[0]]) for nodes in layout for node in nodes[1:] + nodes[:1]]
        urls = self._call([host for _, host in launchers], "launch",
                          [([places[slot].device for slot in node.slots], node) for node, _ in launchers])
        self.urls = [url for url in urls if url is not None]
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
            self._call([host for e in restarted for host in self.node_hosts[e]], "relaunch",
                       [()] * sum(len(self.node_hosts[e]) for e in restarted))
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


def _ray_hosts(settings: RolloutSettings, pool, size: int) -> list:
    """One host actor per bundle of the rollout pool, in the pool's node-sorted order."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host_class = ray.remote(EngineHost)
    resources = {"num_gpus": 1, "num_cpus": 1} if pool.device == "cuda" else {"num_cpus": 1}
    return [
        host_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pool.placement_group, pool.bundle_order[index]), **resources).remote(settings)
        for index in range(size)
    ]
