"""Where rollouts are generated, as the driver sees it: the engines behind one interface (`EngineFleet`).

Colocated (`ColocatedFleet`): the trainer ranks host the engines, an in-process one per rank
(`rollout.engine=local`) or one SGLang server per `rollout.tensor_parallel_size` ranks, led by the group's first rank
(rank.colocated_engine); weights move through shared memory or CUDA IPC. Disaggregated
(`DisaggregatedFleet`): SGLang servers on their own pool, each supervised by an `EngineHost` there
(pool.engine_host); trainer rank 0 broadcasts the weights to them over NCCL (gloo on CPU, or to a server on
rank 0's own GPU).
"""
from __future__ import annotations

from typing import Optional, Protocol

from rlmegatron.transport.placement import ResourcePool
from rlmegatron.driver.trainer_client import TrainerClient
from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.pool.engine_host import EngineHost
from rlmegatron.rollout.sglang.servers import ServerDevices, server_nodes
from rlmegatron.transport.worker_group import group_on
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult
from rlmegatron.rollout.sglang.client import ServerUnavailable
from rlmegatron.tracking.progress import Progress


HOST_CONCURRENCY = 4
"""Calls a rollout-pool host runs at once."""


class EngineFleet(Protocol):
    """The engines the fit loop generates with, numbered 0 .. count-1."""

    @property
    def count(self) -> int:
        ...

    def generate(self, shares: dict[int, list[GenerationRequest]],
                 progress: Progress = None) -> dict[int, Optional[list[GenerationResult]]]:
        """Engine -> its samples for its share of the requests; None: the engine restarted and lost the weights:
        `sync` them to it (`restarted`), then send its share again."""

    def release_memory(self) -> None:
        """Generation is over for this step: engines that share GPUs with the trainer give their memory back."""

    def sync(self, version: str, restarted: Optional[list[int]] = None) -> None:
        """The trained weights to every engine, or to the `restarted` ones."""

    def shutdown(self) -> None:
        ...


class ColocatedFleet:
    """The engines inside the trainer ranks: generation goes to the ranks that lead one."""

    def __init__(self, ranks: TrainerClient, sleeps: bool = True) -> None:
        """`sleeps`: the engines give memory back while the trainer runs. A local engine on the CPU has none to
        give, and then no call is made: it was a round trip to every rank per step for nothing."""
        self.ranks = ranks
        self.leaders = ranks.engine_ranks()
        """The rank that leads each engine."""
        self.sleeps = sleeps

    @property
    def count(self) -> int:
        return len(self.leaders)

    def generate(self, shares: dict[int, list[GenerationRequest]],
                 progress: Progress = None) -> dict[int, Optional[list[GenerationResult]]]:
        replies = self.ranks.generate({self.leaders[engine]: share for engine, share in shares.items()}, progress)
        return {engine: replies[self.leaders[engine]] for engine in shares}

    def release_memory(self) -> None:
        if self.sleeps:
            self.ranks.release_rollout_memory()

    def sync(self, version: str, restarted: Optional[list[int]] = None) -> None:
        self.ranks.sync_weights(version, restarted)

    def shutdown(self) -> None:
        """The ranks stop their engines when the ranks shut down."""


class DisaggregatedFleet:
    """The servers of the rollout pool. Their hosts are Ray actors on `pool`, or (no pool: a run without Ray) live in
    this process."""

    def __init__(self, settings: RolloutSettings, ranks: TrainerClient, pool: Optional[ResourcePool] = None) -> None:
        self.ranks = ranks
        self.partial_rollout = settings.partial_rollout
        size = settings.pool_size
        # A host serves its engine's generation and, meanwhile (trainer.mode one_step_off, async), the weight push.
        self.hosts = group_on(pool, size, EngineHost, settings, concurrency=HOST_CONCURRENCY)
        places = self.hosts.call_all(EngineHost.place)
        tp_size = settings.tensor_parallel_size
        layout = server_nodes(places, tp_size, size // tp_size)
        self.devices: list[ServerDevices] = [tuple((places[slot].node, places[slot].device)
                                                   for node in nodes for slot in node.slots) for nodes in layout]
        """Per engine, where its TP ranks sit: trainer rank 0 picks its weight-update group's backend from it."""
        # Per engine: the launching host of each node, node 0's (the leader) last, so the hosts in this process
        # have started the other nodes before the leader waits for the whole server.
        self.node_hosts = [[node.slots[0] for node in nodes[1:] + nodes[:1]] for nodes in layout]
        self.leaders = [hosts[-1] for hosts in self.node_hosts]
        launches = {node.slots[0]: ([places[slot].device for slot in node.slots], node)
                    for nodes in layout for node in nodes[1:] + nodes[:1]}
        urls = self.hosts.call_each(EngineHost.launch, launches)
        self.urls = [urls[leader] for leader in self.leaders]
        self.connect(list(range(self.count)))
        self.sync("init")

    @property
    def count(self) -> int:
        return len(self.leaders)

    def connect(self, engines: list[int]) -> None:
        """Trainer rank 0 joins a fresh weight-update group with each of `engines`."""
        self.ranks.connect_engines([(e, self.urls[e], self.devices[e]) for e in engines])

    def generate(self, shares: dict[int, list[GenerationRequest]],
                 progress: Progress = None) -> dict[int, Optional[list[GenerationResult]]]:
        replies = self.hosts.call_each(EngineHost.generate,
                                       {self.leaders[e]: (share, progress) for e, share in shares.items()})
        return {e: replies[self.leaders[e]] for e in shares}

    def release_memory(self) -> None:
        """Disaggregated servers keep their memory: nothing else runs on their GPUs."""

    def sync(self, version: str, restarted: Optional[list[int]] = None) -> None:
        """A push to every engine leaves out the servers that are down or restarted (`EngineHost.takes_weights`),
        or that go down during it (`DistributedWeightPush.push`): the push is collective over the trainer ranks and
        must not fail on one server. The generation that meets such a server restarts it and syncs it as
        `restarted`, then sends its share again."""
        if restarted is not None:
            self.hosts.call_each(EngineHost.relaunch, {host: () for e in restarted for host in self.node_hosts[e]})
            self.connect(restarted)  # a restarted server left its old group
        targets = list(range(self.count)) if restarted is None else restarted
        leaders = {self.leaders[e]: () for e in targets}
        paused = self.hosts.call_each(EngineHost.pause_generation, leaders) if self.partial_rollout else {}
        left_out = []
        if restarted is None:
            ready = self.hosts.call_each(EngineHost.takes_weights, leaders)
            left_out = [e for e in targets if not (ready[self.leaders[e]] and paused.get(self.leaders[e], True))]
            targets = [e for e in targets if e not in left_out]
        down = self.ranks.sync_weights(version, restarted, left_out)
        if self.partial_rollout:
            self.hosts.call_each(EngineHost.continue_generation, {leader: () for leader in paused})
        if restarted is not None and down:
            # A restart is bounded (SGLangEngine.max_restarts), a re-sync must be too: no second chance here.
            raise ServerUnavailable(f"rollout engines {down} went down again while they got the weights after a "
                                    "restart")
        self.hosts.call_each(EngineHost.weights_pushed, {self.leaders[e]: (version,) for e in targets
                                                         if e not in down})

    def shutdown(self) -> None:
        self.hosts.shutdown()
