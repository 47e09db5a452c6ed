"""Where rollouts are generated, as the driver sees it: one `EngineFleet` the rest of the driver calls `generate` and
`sync` on, and which alone knows how engines fail and come back.

The engines live in one of two places (`EngineBackend`). In the trainer ranks (`InTrainerRanks`, colocated): an
in-process engine per rank (`rollout.engine=local`) or one SGLang server per `rollout.tensor_parallel_size` ranks, led
by the group's first rank (rank.colocated_engine); weights move through shared memory or CUDA IPC. On a rollout pool
of their own (`OnRolloutPool`, disaggregated): SGLang servers each supervised by an `EngineHost` there
(pool.engine_host); every trainer rank broadcasts the weights to its share of them over NCCL (gloo on CPU, or to a
server on the sender's own GPU), all at once (rank.weight_push.sending_ranks).

Recovery, all of it here: an engine whose server failed restarts itself inside its next generation and answers None
(it holds no weights); the fleet relaunches it where that takes more (the other nodes of its server, its weight-update
group with its sending trainer rank), pushes it the fleet's weights whole, and sends its share again. A server that is
down when weights are pushed, or goes down during the push, is left out of it (the push is collective over the trainer
ranks and must not fail on one server); the generation that next meets it recovers it the same way.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from rlmegatron.driver.rollout_data import merge_results, shard_requests
from rlmegatron.driver.trainer_client import TrainerClient
from rlmegatron.pool.engine_host import EngineHost
from rlmegatron.errors import EngineCannotJoin
from rlmegatron.rollout.delta import SyncBytes
from rlmegatron.rollout.engine import INITIAL_VERSION, GenerationRequest, GenerationResult
from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.rollout.sglang.client import ServerUnavailable
from rlmegatron.rollout.sglang.server import ServerStartupError
from rlmegatron.rollout.sglang.servers import ServerDevices, server_nodes
from rlmegatron.tracking.progress import Progress
from rlmegatron.transport.placement import ResourcePool, alive_nodes, create_pool, remove_pool
from rlmegatron.transport.worker_group import group_on

HOST_CONCURRENCY = 4
"""Calls a rollout-pool host runs at once."""
JOIN_WAIT_S = 60.0
"""How long an engine that joins a running job waits for Ray to place its hosts."""

Answers = dict[int, Optional[list[GenerationResult]]]


class EngineBackend(Protocol):
    """Where the engines, numbered 0 .. count-1, live and how each step of a push or a recovery reaches them."""

    ranks: TrainerClient

    @property
    def count(self) -> int:
        ...

    @property
    def engines(self) -> list[int]:
        """The engines' numbers (0 .. count-1, unless engines joined or left the pool)."""

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

    def add(self, count: int) -> list[int]:
        """`count` engines started (they hold no weights yet); their numbers."""

    def remove(self, engines: list[int]) -> None:
        """`engines` stopped and forgotten."""

    def joined_nodes(self) -> list[str]:
        """The addresses of the cluster's nodes that joined since the last call: room for engines."""

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
        self.versions: dict[int, Optional[str]] = dict.fromkeys(backend.engines, held)
        """Each engine's weights; None: none (started or restarted, not yet pushed to)."""
        self.membership = threading.Condition()
        self.busy: collections.Counter[int] = collections.Counter()
        """Generations running on each engine: one that leaves waits for its own to end (`shrink`)."""
        self.leaving: set[int] = set()
        self.joining: set[int] = set()
        """Engines `grow` started and has not yet pushed to."""
        if held is None:
            self.sync(INITIAL_VERSION)

    @property
    def count(self) -> int:
        return self.backend.count

    def generate(self, requests: list[GenerationRequest], progress: Progress = None) -> list[GenerationResult]:
        """Every request's samples, the requests spread evenly over the engines, in request order."""
        with self.membership:
            engines = [engine for engine in self.backend.engines if engine not in self.leaving]
            # One that joins (`grow`) is in the backend's list before its first push, its server holding the
            # checkpoint's weights: it takes no sample until then, unless no other engine is there to take them.
            # (One down or restarted is sent its share: the generation that meets it restarts it and pushes to it,
            # `_recover`.)
            engines = [engine for engine in engines if engine in self.versions and engine not in self.joining] \
                or engines
            self.busy.update(engines)
        try:
            shares = dict(zip(engines, shard_requests(requests, len(engines))))
            answers = self.backend.generate(shares, progress)
            # Each engine bounds its own restarts, so this loop ends.
            while restarted := [engine for engine, answer in answers.items() if answer is None]:
                self._recover(restarted)
                answers.update(self.backend.generate({engine: shares[engine] for engine in restarted}, progress))
        finally:
            with self.membership:
                self.busy.subtract(engines)
                self.membership.notify_all()
        return merge_results(list(shares.values()), [answers[engine] for engine in shares])

    def grow(self, count: int) -> list[int]:
        """`count` engines more (the backend starts them), each given the fleet's weights whole before it takes a
        request; returns their numbers."""
        with self.backend.ranks.owner:  # the push is collective over the trainer ranks
            added = self.backend.add(count)
            with self.membership:
                self.versions.update(dict.fromkeys(added, None))
                self.joining.update(added)
            try:
                if down := self._push(self.version, added, fresh=True):
                    self.backend.remove(added)
                    with self.membership:
                        for engine in added:
                            del self.versions[engine]
                    raise EngineCannotJoin(f"rollout engines {down} went down while they got their first weights")
                self._pushed(self.version, added)
            finally:
                with self.membership:
                    self.joining.difference_update(added)
        return added

    def joined_nodes(self) -> list[str]:
        """The addresses of the nodes that joined the cluster since the last call (`OnRolloutPool` on Ray)."""
        return self.backend.joined_nodes()

    def shrink(self, engines: list[int]) -> None:
        """`engines` leave: no new request goes to them, what they run now finishes (no sample is lost), then they
        stop, leave the router and their weight-update groups."""
        with self.membership:
            self.leaving.update(engines)
            self.membership.wait_for(lambda: not any(self.busy[engine] for engine in engines))
        with self.backend.ranks.owner:  # no push to them is under way, and none starts
            self.backend.remove(engines)
            with self.membership:
                for engine in engines:
                    self.versions.pop(engine, None)
                self.leaving.difference_update(engines)

    def release_memory(self) -> None:
        self.backend.release_memory()

    def sync(self, version: str) -> None:
        """`version` of the trained weights to every engine that can take it now; whole to one that holds none."""
        with self.backend.ranks.owner:  # collective over the trainer ranks (TrainerClient.owner)
            asked = list(self.backend.engines)
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

    @property
    def engines(self) -> list[int]:
        return list(range(self.count))

    def add(self, count: int) -> list[int]:
        raise NotImplementedError("colocated engines live in the trainer ranks: the pool cannot grow (config/checks.py "
                                  "refuses rollout_max_engines with placement.mode=colocate)")

    remove = add

    def joined_nodes(self) -> list[str]:
        """Colocated engines take no nodes of their own."""
        return []

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


@dataclass
class EngineSlot:
    """One server of the rollout pool: its hosts (members of `hosts`), where its TP ranks sit, its URL."""

    hosts: Any
    """The WorkerGroup[EngineHost] its hosts are members of: the pool's first group, or one of its own (joined)."""
    node_hosts: list[int]
    """The launching host of each of its nodes, node 0's (the leader) last."""
    url: str
    devices: ServerDevices
    own_group: bool
    pool: Optional[ResourcePool] = None
    """Joined on Ray: the placement group of its own hosts."""

    @property
    def leader(self) -> int:
        return self.node_hosts[-1]


class OnRolloutPool:
    """Disaggregated: the servers of the rollout pool. Their hosts are Ray actors on `pool`, or (no pool: a run
    without Ray) live in this process. Engines may join (`add`: on Ray, each on a placement group of its own) and
    leave (`remove`) while the job runs."""

    def __init__(self, settings: RolloutSettings, ranks: TrainerClient, pool: Optional[ResourcePool] = None) -> None:
        self.settings, self.ranks, self.pool = settings, ranks, pool
        self.slots: dict[int, EngineSlot] = {}
        self.lock = threading.Lock()
        """Held while `slots` changes: generation ahead (one_step_off, async) reads it meanwhile."""
        self.next_engine = 0
        """Engines are numbered in the order they joined; a number is never given twice."""
        # A host serves its engine's generation and, meanwhile (trainer.mode one_step_off, async), the weight push.
        self.known_nodes = {node.id for node in alive_nodes()} if pool is not None else set()
        """The Ray nodes of the cluster as `joined_nodes` last saw it."""
        self.hosts = group_on(pool, settings.pool_size, EngineHost, settings, concurrency=HOST_CONCURRENCY)
        self._launch(self.hosts, own_group=False)
        self._connect(self.engines)

    def _launch(self, hosts, own_group: bool) -> list[int]:
        """A server on every `tensor_parallel_size` hosts of `hosts`; their engine numbers."""
        places = hosts.call_all(EngineHost.place)
        tp_size = self.settings.tensor_parallel_size
        layout = server_nodes(places, tp_size, len(places) // tp_size)
        # Per engine: the launching host of each node, node 0's (the leader) last, so the hosts in this process
        # have started the other nodes before the leader waits for the whole server.
        launches = {node.slots[0]: ([places[slot].device for slot in node.slots], node)
                    for nodes in layout for node in nodes[1:] + nodes[:1]}
        urls = hosts.call_each(EngineHost.launch, launches)
        with self.lock:
            first = self.next_engine
            for offset, nodes in enumerate(layout):
                node_hosts = [node.slots[0] for node in nodes[1:] + nodes[:1]]
                # Where its TP ranks sit: its sending trainer rank picks its weight-update group's backend from it.
                devices = tuple((places[slot].node, places[slot].device) for node in nodes for slot in node.slots)
                self.slots[first + offset] = EngineSlot(hosts, node_hosts, urls[node_hosts[-1]], devices, own_group)
            self.next_engine += len(layout)
        return list(range(first, first + len(layout)))

    @property
    def count(self) -> int:
        return len(self.slots)

    @property
    def engines(self) -> list[int]:
        with self.lock:
            return sorted(self.slots)

    @property
    def urls(self) -> list[str]:
        return [self.slots[engine].url for engine in self.engines]

    @property
    def leaders(self) -> list[int]:
        return [self.slots[engine].leader for engine in self.engines]

    def _each(self, method: Callable[..., Any], per_engine: dict[int, tuple]) -> dict[int, Any]:
        """`method` on each engine's leader host, with its arguments; engines whose hosts are in different groups
        (one joined mid-run) are called at once, each group on a thread."""
        by_group: dict[int, dict[int, tuple]] = {}
        for engine, args in per_engine.items():
            by_group.setdefault(id(self.slots[engine].hosts), {})[engine] = args

        def call(engines: dict[int, tuple]) -> dict[int, Any]:
            hosts = self.slots[next(iter(engines))].hosts
            replies = hosts.call_each(method, {self.slots[e].leader: args for e, args in engines.items()})
            return {e: replies[self.slots[e].leader] for e in engines}

        if len(by_group) <= 1:
            return call(next(iter(by_group.values()))) if by_group else {}
        with ThreadPoolExecutor(len(by_group)) as threads:
            return {e: reply for replies in threads.map(call, by_group.values()) for e, reply in replies.items()}

    def _connect(self, engines: list[int]) -> None:
        """Each of `engines` joins a fresh weight-update group with its sending trainer rank."""
        self.ranks.connect_engines([(e, self.slots[e].url, self.slots[e].devices) for e in engines])

    def joined_nodes(self) -> list[str]:
        """The addresses of the Ray nodes that joined since the last call (none without Ray)."""
        if self.pool is None:
            return []
        alive = {node.id: node.address for node in alive_nodes()}
        joined = [address for node, address in alive.items() if node not in self.known_nodes]
        self.known_nodes |= alive.keys()
        return joined

    def add(self, count: int) -> list[int]:
        """`count` servers more, each on hosts of its own: on Ray a placement group per server
        (`placement.engine_pool`: PlacementUnsatisfiable, one line, when the cluster has no room), else in this
        process. Each joins a weight-update group with its sending trainer rank; they hold no weights yet."""
        added = []
        tp_size = self.settings.tensor_parallel_size
        try:
            for _ in range(count):
                pool = None if self.pool is None else create_pool("rollout engine", 1, tp_size, self.settings.device,
                                                                 JOIN_WAIT_S, self.pool.shared)
                hosts = None
                try:
                    hosts = group_on(pool, tp_size, EngineHost, self.settings, concurrency=HOST_CONCURRENCY)
                    joined = self._launch(hosts, own_group=True)
                except (ServerStartupError, ServerUnavailable) as failed:  # it never served: nothing to keep
                    self._release(EngineSlot(hosts, [], "", (), True, pool) if hosts is not None else None, pool)
                    raise EngineCannotJoin(f"a rollout engine did not start: {failed}") from None
                for engine in joined:
                    self.slots[engine].pool = pool
                added += joined
            self._connect(added)
        except BaseException:
            self.remove(added)  # those that did start, whatever stopped the others
            raise
        return added

    def remove(self, engines: list[int]) -> None:
        """Each server stops (leaving the router first) and its sending trainer rank leaves its weight-update group;
        hosts started for it alone go too (and, on Ray, their placement group)."""
        self.ranks.disconnect_engines(engines)
        for engine in engines:
            with self.lock:
                slot = self.slots.pop(engine)
            if slot.own_group:
                self._release(slot)
            else:  # its hosts are members of the pool's first group, which lives on
                slot.hosts.call_each(EngineHost.shutdown, {host: () for host in slot.node_hosts})

    def generate(self, shares: dict[int, list[GenerationRequest]], progress: Progress = None) -> Answers:
        return self._each(EngineHost.generate, {e: (share, progress) for e, share in shares.items()})

    def release_memory(self) -> None:
        """Disaggregated servers keep their memory: nothing else runs on their GPUs."""

    def relaunch(self, engines: list[int]) -> None:
        """The server's other nodes start again, node 0 waits for them, and it joins a new weight-update group (a
        restarted server left its old one)."""
        for engine in engines:
            slot = self.slots[engine]
            slot.hosts.call_each(EngineHost.relaunch, {host: () for host in slot.node_hosts})
        self._connect(engines)

    def pause(self, engines: list[int]) -> list[int]:
        """Each server holds its generation for the push, which takes an update call per bucket: no request runs
        on half-updated weights (`SGLangEngine.pause_generation`). A server that is down, or restarted and so
        outside its sender's weight-update group (`EngineHost.takes_weights`), is left out."""
        paused = self._each(EngineHost.pause_generation, dict.fromkeys(engines, ()))
        ready = self._each(EngineHost.takes_weights, dict.fromkeys(engines, ()))
        return [e for e in engines if ready[e] and paused[e]]

    def resume(self, engines: list[int]) -> None:
        self._each(EngineHost.continue_generation, dict.fromkeys(engines, ()))

    def alive(self, engines: list[int]) -> list[int]:
        """Those of `engines` whose server answers: a push failed on them though they live (it was refused)."""
        replies = self._each(EngineHost.takes_weights, dict.fromkeys(engines, ()))
        return [e for e in engines if replies[e]]

    def pushed(self, version: str, engines: list[int]) -> None:
        self._each(EngineHost.weights_pushed, {e: (version,) for e in engines})

    def shutdown(self) -> None:
        for slot in list(self.slots.values()):
            if slot.own_group:
                self._release(slot)
        self.hosts.shutdown()

    @staticmethod
    def _release(slot: Optional[EngineSlot], pool: Optional[ResourcePool] = None) -> None:
        """A joined engine's own hosts, and its placement group (`pool` when its hosts never started)."""
        if slot is not None:
            slot.hosts.shutdown()
            pool = slot.pool or pool
        if pool is not None:
            remove_pool(pool)
