"""Where rollouts are generated, as the trainer sees it.

Colocated: the trainer ranks host the engines, an in-process one per rank (`rollout.engine=local`) or one SGLang
server per `rollout.tensor_parallel_size` ranks, led by the group's first rank; weights move through shared memory
or CUDA IPC. Disaggregated: SGLang servers on their own pool, each supervised by an `EngineHost`; trainer rank 0
broadcasts the weights to them over NCCL (gloo on CPU).
"""
from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rlmegatron.controller.role_settings import RolloutSettings, rollout_settings
from rlmegatron.controller.servers import (
    Place,
    ServerNode,
    generate_or_none,
    launch_spec,
    server_nodes,
    sglang_engine,
    this_place,
)
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, RolloutEngine
from rlmegatron.tracking.progress import Progress

if TYPE_CHECKING:
    from rlmegatron.config import JobSpec


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

        server = launch_spec(self.settings, devices, socket.gethostbyname(socket.gethostname()), node)
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
