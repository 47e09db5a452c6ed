"""Where rollouts are generated, as the driver sees it: one `EngineFleet` the rest of the driver calls `generate` and
`sync` on, and which alone knows how engines fail and come back.

The engines live in one of two places (`EngineBackend`). In the trainer ranks (`InTrainerRanks`, colocated): an
in-process engine per rank (`rollout.engine=local`) or one SGLang server per `rollout.tensor_parallel_size` ranks, led
by the group's first rank (rank.colocated_engine); weights move through shared memory or CUDA IPC. On a rollout pool
of their own (`OnRolloutPool`, disaggregated): SGLang servers each supervised by an `EngineHost` there
(pool.engine_host); trainer rank 0 broadcasts the weights to them over NCCL (gloo on CPU, or to a server on rank 0's
own GPU).

Recovery, all of it here: an engine whose server failed restarts itself inside its next generation and answers None
(it holds no weights); the fleet relaunches it where that takes more (the other nodes of its server, its place in
trainer rank 0's weight-update groups), pushes it the fleet's weights whole, and sends its share again. A server that
is down when weights are pushed, or goes down during the push, is left out of it (the push is collective over the
trainer ranks and must not fail on one server); the generation that next meets it recovers it the same way.
"""
from __future__ import annotations

from typing import Optional, Protocol

from rlmegatron.driver.rollout_data import merge_results, shard_requests
from rlmegatron.driver.trainer_client import TrainerClient
from rlmegatron.pool.engine_host import EngineHost
from rlmegatron.rollout.delta import SyncBytes
from rlmegatron.rollout.engine import INITIAL_VERSION, GenerationRequest, GenerationResult
from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.rollout.sglang.client import ServerUnavailable
from rlmegatron.rollout.sglang.servers import ServerDevices, server_nodes
from rlmegatron.tracking.progress import Progress
from rlmegatron.transport.placement import ResourcePool
from rlmegatron.transport.worker_group import group_on

HOST_CONCURRENCY = 4
"""Calls a rollout-pool host runs at once."""

Answers = dict[int, Optional[list[GenerationResult]]]


class EngineBackend(Protocol):
    """Where the engines, numbered 0 .. count-1, live and how each step of a push or a recovery reaches them."""

    ranks: TrainerClient

    @property
    def count(self) -> int:
        ...

    def generate(self, shares: dict[int, list[GenerationRequest]], progress: Progress = None) -> Answers:
        """Engine -> its samples for its share; None: it restarted and holds no weights."""

    def release_memory(self) -> None:
        """Generation is over for this step: engines that share GPUs with the trainer give their memory back."""

    def relaunch(self, engines: list[int]) -> None:
        """What a restarted engine needs beyond its own restart before it can take weights."""

    def pause(self, engines: list[int]) -> list[int]:
        """Before a push: the engines that can take it now (the others are down)."""

    def resume(self, engines: list[int]) -> None:
        """After a push: `engines` (those `pause` was asked for) go on generating."""

    def pushed(self, version: str, engines: list[int]) -> None:
        """`engines` hold `version` now."""

    def alive(self, engines: list[int]) -> list[int]:
        """Those of `engines`, left out of a push, that still answer: it was refused, not lost."""

    def shutdown(self) -> None:
        ...


class EngineFleet:
    """The rollout engines behind `generate` and `sync`, and the weight version each one holds."""

    def __init__(self, backend: EngineBackend, held: Optional[str] = None) -> None:
        """`held`: the version every engine starts with (colocated: the ranks pushed the initial weights as they built
        their engines); None: they start empty and get the initial weights now."""
        self.backend = backend
        self.carried, self.full_pushes = SyncBytes(), 0
        """What the pushes since the last `sync_metrics` carried."""
        self.version = INITIAL_VERSION
        """The weights the engines should hold: the last pushed."""
        self.versions: dict[int, Optional[str]] = dict.fromkeys(range(backend.count), held)
        """Each engine's weights; None: none (started or restarted, not yet pushed to)."""
        if held is None:
            self.sync(INITIAL_VERSION)

    @property
    def count(self) -> int:
        return self.backend.count

    def generate(self, requests: list[GenerationRequest], progress: Progress = None) -> list[GenerationResult]:
        """Every request's samples, the requests spread evenly over the engines, in request order."""
        shares = shard_requests(requests, self.count)
        answers = self.backend.generate(dict(enumerate(shares)), progress)
        # Each engine bounds its own restarts, so this loop ends.
        while restarted := [engine for engine, answer in answers.items() if answer is None]:
            self._recover(restarted)
            answers.update(self.backend.generate({engine: shares[engine] for engine in restarted}, progress))
        return merge_results(shares, [answers[engine] for engine in range(len(shares))])

    def release_memory(self) -> None:
        self.backend.release_memory()

    def sync(self, version: str) -> None:
        """`version` of the trained weights to every engine that can take it now; whole to one that holds none."""
        with self.backend.ranks.owner:  # collective over the trainer ranks (TrainerClient.owner)
            asked = list(range(self.count))
            ready = self.backend.pause(asked)
            try:
                fresh = [engine for engine in ready if self.versions[engine] is None]
                held = [engine for engine in ready if engine not in fresh]
                down = self._push(version, held, fresh=False) + self._push(version, fresh, fresh=True)
            finally:
                self.backend.resume(asked)
            self.version = version
            self._pushed(version, [engine for engine in ready if engine not in down])
            # A server that refused part of the push (a bucket, or the flush of the cache the old weights made) but
            # lives is outside its group's stream: a new group and the weights whole, now. One that is down is
            # restarted by the generation that next meets it.
            if down and (refused := self.backend.alive(down)):
                self._recover(refused)

    def _recover(self, engines: list[int]) -> None:
        # Made ahead of the loop (rollout_buffer.Ahead), this waits for the owner lock until the loop waits for it.
        with self.backend.ranks.owner:
            for engine in engines:
                self.versions[engine] = None
            self.backend.relaunch(engines)
            if down := self._push(self.version, engines, fresh=True):
                # A restart is bounded (SGLangEngine.max_restarts), a re-sync must be too: no second chance here.
                raise ServerUnavailable(f"rollout engines {down} went down again while they got the weights after "
                                        "a restart")
            self._pushed(self.version, engines)

    def _push(self, version: str, engines: list[int], fresh: bool) -> list[int]:
        """The engines of `engines` that went down during the push."""
        if not engines:
            return []
        report = self.backend.ranks.sync_weights(version, engines, fresh)
        self.carried.add(report.bytes)
        self.full_pushes += report.full
        return report.down

    def sync_metrics(self) -> dict[str, float]:
        """What the syncs since the last call carried (weight_sync/*): bytes sent, the bytes full pushes of the same
        tensors would have sent, their ratio, tensors that changed, and how many pushes were full."""
        carried, full_pushes = self.carried, self.full_pushes
        self.carried, self.full_pushes = SyncBytes(), 0
        if not carried.full:
            return {}
        return {"weight_sync/bytes_sent": float(carried.sent), "weight_sync/bytes_full": float(carried.full),
                "weight_sync/sent_ratio": carried.sent / carried.full,
                "weight_sync/tensors_changed": float(carried.tensors_changed),
                "weight_sync/full_pushes": float(full_pushes)}

    def _pushed(self, version: str, engines: list[int]) -> None:
        for engine in engines:
            self.versions[engine] = version
        self.backend.pushed(version, engines)

    def shutdown(self) -> None:
        self.backend.shutdown()


class InTrainerRanks:
    """Colocated: the engines inside the trainer ranks; generation goes to the ranks that lead one."""

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

    def generate(self, shares: dict[int, list[GenerationRequest]], progress: Progress = None) -> Answers:
        replies = self.ranks.generate({self.leaders[engine]: share for engine, share in shares.items()}, progress)
        return {engine: replies[self.leaders[engine]] for engine in shares}

    def release_memory(self) -> None:
        if self.sleeps:
            self.ranks.release_rollout_memory()

    def relaunch(self, engines: list[int]) -> None:
        self.ranks.relaunch_engines(engines)

    def pause(self, engines: list[int]) -> list[int]:
        """A colocated engine never runs beside a push: the trainer ranks that host it do one or the other."""
        return engines

    def resume(self, engines: list[int]) -> None:
        """Nothing was paused."""

    def pushed(self, version: str, engines: list[int]) -> None:
        """Each engine recorded the version as it took the weights."""

    def alive(self, engines: list[int]) -> list[int]:
        """A push into the trainer ranks' own engines leaves none out."""
        return []

    def shutdown(self) -> None:
        """The ranks stop their engines when the ranks shut down."""


class OnRolloutPool:
    """Disaggregated: the servers of the rollout pool. Their hosts are Ray actors on `pool`, or (no pool: a run
    without Ray) live in this process."""

    def __init__(self, settings: RolloutSettings, ranks: TrainerClient, pool: Optional[ResourcePool] = None) -> None:
        self.ranks = ranks
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
        self._connect(list(range(self.count)))

    @property
    def count(self) -> int:
        return len(self.leaders)

    def _connect(self, engines: list[int]) -> None:
        """Trainer rank 0 joins a fresh weight-update group with each of `engines`."""
        self.ranks.connect_engines([(e, self.urls[e], self.devices[e]) for e in engines])

    def generate(self, shares: dict[int, list[GenerationRequest]], progress: Progress = None) -> Answers:
        replies = self.hosts.call_each(EngineHost.generate,
                                       {self.leaders[e]: (share, progress) for e, share in shares.items()})
        return {e: replies[self.leaders[e]] for e in shares}

    def release_memory(self) -> None:
        """Disaggregated servers keep their memory: nothing else runs on their GPUs."""

    def relaunch(self, engines: list[int]) -> None:
        """The server's other nodes start again, node 0 waits for them, and it joins a new weight-update group (a
        restarted server left its old one)."""
        self.hosts.call_each(EngineHost.relaunch, {host: () for e in engines for host in self.node_hosts[e]})
        self._connect(engines)

    def pause(self, engines: list[int]) -> list[int]:
        """Each server holds its generation for the push, which takes an update call per bucket: no request runs
        on half-updated weights (`SGLangEngine.pause_generation`). A server that is down, or restarted and so
        outside trainer rank 0's weight-update group (`EngineHost.takes_weights`), is left out."""
        leaders = {self.leaders[e]: () for e in engines}
        paused = self.hosts.call_each(EngineHost.pause_generation, leaders)
        ready = self.hosts.call_each(EngineHost.takes_weights, leaders)
        return [e for e in engines if ready[self.leaders[e]] and paused[self.leaders[e]]]

    def resume(self, engines: list[int]) -> None:
        self.hosts.call_each(EngineHost.continue_generation, {self.leaders[e]: () for e in engines})

    def alive(self, engines: list[int]) -> list[int]:
        """Those of `engines` whose server answers: a push failed on them though they live (it was refused)."""
        replies = self.hosts.call_each(EngineHost.takes_weights, {self.leaders[e]: () for e in engines})
        return [e for e in engines if replies[self.leaders[e]]]

    def pushed(self, version: str, engines: list[int]) -> None:
        self.hosts.call_each(EngineHost.weights_pushed, {self.leaders[e]: (version,) for e in engines})

    def shutdown(self) -> None:
        self.hosts.shutdown()
