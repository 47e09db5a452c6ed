"""Resource pools as Ray placement groups: one bundle per node, holding that node's GPUs (CPU ranks on CPU), spread
over distinct nodes; colocated or disaggregated.

A bundle per node, not per GPU, is what makes the placement exact: a node's bundle is placed whole on one node, and
STRICT_SPREAD puts no two of a pool's bundles on one node, so every node gets exactly `per_node` ranks, and the ranks
of a node are contiguous in rank order (TP, Megatron's innermost group, never spans nodes). Bundles per GPU under
PACK may put 3 of 4 on one node and 1 on another.

Disaggregated, the rollout pool takes nodes of its own when the cluster has them (one placement group, every bundle
on a distinct node: the engines never share a node's GPUs, NICs or host memory with training); on a cluster with
fewer nodes, each pool is spread over its own nodes and the two may share one (an 8-GPU box split 4 + 4).

A cluster that cannot hold the placement is refused at once, naming what it lacks; one whose nodes are big enough
but busy gets PLACEMENT_WAIT_S to free them. Both are the user's to fix (exit 2), never a hang.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from rlmegatron.errors import UserError
from rlmegatron.transport.shared_files import SharedFiles

if TYPE_CHECKING:
    from rlmegatron.config.spec import PlacementConfig

PLACEMENT_WAIT_S = 120.0
"""How long a placement the cluster can hold waits for busy nodes (other jobs' actors) to free their devices."""


class PlacementUnsatisfiable(UserError):
    """The Ray cluster cannot hold the job's placement (too few nodes, or too few devices on them), or did not free
    them in time."""


@dataclass(frozen=True)
class ResourcePool:
    """A pool's ranks: `per_node` on each of its nodes' bundles (`first_bundle` on), in rank order."""

    name: str
    placement_group: object
    first_bundle: int
    per_node: int
    device: str
    nodes: tuple[str, ...]
    """The Ray node id of each rank, in rank order."""
    addresses: tuple[str, ...]
    """The IP of each rank's node, in rank order."""
    shared: Optional[SharedFiles] = None
    """The driver's files its members move into (on a cluster Ray was started on apart from the run)."""

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    def bundle_of(self, rank: int) -> int:
        """The placement-group bundle (its node's) that rank `rank` takes one device of."""
        return self.first_bundle + rank // self.per_node

    def describe(self, member: str = "rank") -> str:
        """'2 ranks on 2 nodes: 127.0.0.3 (rank 0), 127.0.0.4 (rank 1)'."""
        by_node: dict[str, list[int]] = {}
        for rank, address in enumerate(self.addresses):
            by_node.setdefault(address, []).append(rank)
        nodes = ", ".join(f"{address} ({member}{'s' * (len(ranks) > 1)} {_span(ranks)})" for address, ranks in
                          by_node.items())
        return f"{self.world_size} {member}{'s' * (self.world_size != 1)} on {len(by_node)} node" \
               f"{'s' * (len(by_node) != 1)}: {nodes}"


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


@dataclass(frozen=True)
class Pools:
    trainer: ResourcePool
    rollout: ResourcePool
    """The trainer's own pool when colocated: engines live in the trainer ranks and release memory while they train."""

    @property
    def colocated(self) -> bool:
        return self.rollout is self.trainer


def device_resource(device: str) -> str:
    """The Ray resource a rank takes one of: a GPU, or on CPU the CPU it runs on."""
    return "GPU" if device == "cuda" else "CPU"


def node_bundle(device: str, per_node: int) -> dict[str, float]:
    # On GPU a rank also needs a CPU for its Python process; on CPU the CPU is the device.
    return {"GPU": per_node, "CPU": per_node} if device == "cuda" else {"CPU": per_node}


@dataclass(frozen=True)
class Node:
    """An alive Ray node as placement sees it."""

    id: str
    address: str
    resources: dict[str, float]


@dataclass(frozen=True)
class Ask:
    """One pool's need: `nnodes` distinct nodes with `per_node` of the device each."""

    name: str
    nnodes: int
    per_node: int
    fields: str
    """The spec fields that ask it, for the message."""


def _fits(node: Node, device: str, per_node: int) -> bool:
    return all(node.resources.get(resource, 0) >= amount for resource, amount in node_bundle(device, per_node).items())


def can_hold(nodes: Sequence[Node], device: str, asks: Sequence[Ask]) -> bool:
    """Whether `nodes` can give every ask its nodes, no node to two bundles. Each ask's eligible nodes are those big
    enough for its bundle, so the sets are nested by size, and Hall's condition over the nested unions suffices: for
    each ask, the asks at least as big need no more nodes than those that fit the smallest of them."""
    by_size = sorted(asks, key=lambda ask: ask.per_node, reverse=True)
    needed = 0
    for ask in by_size:
        needed += ask.nnodes
        if sum(_fits(node, device, ask.per_node) for node in nodes) < needed:
            return False
    return True


def missing(nodes: Sequence[Node], device: str, ask: Ask) -> Optional[str]:
    """Why `nodes` cannot hold `ask` on its own, in one sentence; None when they can."""
    if can_hold(nodes, device, [ask]):
        return None
    resource = device_resource(device)
    have = ", ".join(f"{node.address} ({node.resources.get(resource, 0):g} {resource})"
                     for node in sorted(nodes, key=lambda node: node.address)) or "none"
    big = sum(_fits(node, device, ask.per_node) for node in nodes)
    return (f"the {ask.name} needs {ask.nnodes} node{'s' * (ask.nnodes > 1)} with {ask.per_node} {resource} each "
            f"({ask.fields}), and the Ray cluster has {big} such node{'s' * (big != 1)} (alive nodes: {have})")


def alive_nodes(reachable_only: bool = False) -> list[Node]:
    """The nodes Ray's GCS counts alive; with `reachable_only`, less those whose raylet no longer takes a connection.

    The GCS declares a node dead only once it has missed its heartbeats for several seconds, while a rank on it is
    known gone at once: a restart in between would place the new ranks on the dead node again (its bundles are still
    there), and they would die with it. A raylet's port that refuses a connection (its process is gone) or does not
    answer within RAYLET_PROBE_S (its machine is gone) is what tells that sooner."""
    import ray

    return [Node(node["NodeID"], node["NodeManagerAddress"], dict(node["Resources"]))
            for node in ray.nodes()
            if node["Alive"] and (not reachable_only or _takes_connections(node["NodeManagerAddress"],
                                                                               node["NodeManagerPort"]))]


RAYLET_PROBE_S = 2.0


def _takes_connections(address: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((address, port), timeout=RAYLET_PROBE_S).close()
        return True
    except OSError:
        return False


def asks_of(placement: PlacementConfig) -> list[Ask]:
    trainer = Ask("trainer", placement.nnodes, placement.gpus_per_node,
                  f"placement.nnodes={placement.nnodes} x placement.gpus_per_node={placement.gpus_per_node}")
    if placement.mode == "colocate":
        return [trainer]
    return [trainer, Ask("rollout pool", placement.rollout_nnodes, placement.rollout_gpus_per_node,
                         f"placement.rollout_nnodes={placement.rollout_nnodes} x "
                         f"placement.rollout_gpus_per_node={placement.rollout_gpus_per_node}")]


def create_pools(placement: PlacementConfig, shared: Optional[SharedFiles] = None,
                 wait_s: float = PLACEMENT_WAIT_S) -> Pools:
    """The job's pools on the Ray cluster; their members move into `shared` (the driver's files) as they start."""
    nodes = alive_nodes()
    asks = asks_of(placement)
    problems = [problem for problem in (missing(nodes, placement.device, ask) for ask in asks) if problem]
    if problems:
        raise PlacementUnsatisfiable("placement: " + "; ".join(problems) + ". Start more nodes (or nodes with more "
                                     "devices), or ask for fewer")
    device = placement.device
    if len(asks) == 1:
        trainer, = _placed_pools(asks, device, wait_s, nodes, shared)
        return Pools(trainer, trainer)
    if can_hold(nodes, device, asks):
        trainer, rollout = _placed_pools(asks, device, wait_s, nodes, shared)  # nodes of their own
    else:
        trainer, = _placed_pools(asks[:1], device, wait_s, nodes, shared)
        try:
            rollout, = _placed_pools(asks[1:], device, wait_s, nodes, shared)
        except BaseException:
            _remove(trainer.placement_group)
            raise
    return Pools(trainer, rollout)


def create_pool(name: str, nnodes: int, per_node: int, device: str, wait_s: float = PLACEMENT_WAIT_S,
                shared: Optional[SharedFiles] = None) -> ResourcePool:
    """One pool of `nnodes` x `per_node` ranks: outside a job (tests, benchmarks), or a rollout engine that joins a
    running job (`shared`: the job's files)."""
    ask = Ask(name, nnodes, per_node, f"{nnodes} x {per_node}")
    nodes = alive_nodes()
    problem = missing(nodes, device, ask)
    if problem:
        raise PlacementUnsatisfiable(f"placement: {problem}")
    return _placed_pools([ask], device, wait_s, nodes, shared)[0]


def remove_pool(pool: ResourcePool) -> None:
    _remove(pool.placement_group)


def _placed_pools(asks: Sequence[Ask], device: str, wait_s: float, nodes: Sequence[Node],
                  shared: Optional[SharedFiles]) -> list[ResourcePool]:
    """One placement group whose bundles (each ask's nodes, in order) all sit on distinct nodes; a pool per ask."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    bundles = [node_bundle(device, ask.per_node) for ask in asks for _ in range(ask.nnodes)]
    name = "+".join(ask.name.split()[0] for ask in asks)
    group = placement_group(bundles, strategy="STRICT_SPREAD" if len(bundles) > 1 else "STRICT_PACK", name=name)
    if not group.wait(wait_s):
        _remove(group)
        resource = device_resource(device)
        free = ray.available_resources()
        raise PlacementUnsatisfiable(
            f"placement: the Ray cluster has the nodes for the {' and '.join(a.name for a in asks)} "
            f"({'; '.join(a.fields for a in asks)}) but did not free them within {wait_s:.0f} s: other work holds "
            f"them ({free.get(resource, 0):g} {resource} free in the whole cluster). Stop it, or wait and run again")
    node_of = placement_group_table(group)["bundles_to_node_id"]
    address_of = {node.id: node.address for node in nodes} | {node.id: node.address for node in alive_nodes()}
    pools, first = [], 0
    for ask in asks:
        ranks = [node_of[first + rank // ask.per_node] for rank in range(ask.nnodes * ask.per_node)]
        pools.append(ResourcePool(ask.name.split()[0], group, first, ask.per_node, device, tuple(ranks),
                                  tuple(address_of.get(node, "?") for node in ranks), shared))
        first += ask.nnodes
    return pools


def replace_lost(pool: ResourcePool, wait_s: float = PLACEMENT_WAIT_S,
                 say: Callable[[str], None] = lambda line: None) -> ResourcePool:
    """`pool` once Ray has placed again the bundles of a node that died (on a spare node, or the node restarted), for
    the ranks' restart (`say`s that it waits, when it must); PlacementUnsatisfiable naming the lost node when that
    did not happen within `wait_s`."""
    import time

    from ray.util.placement_group import placement_group_table

    alive = {node.id: node.address for node in alive_nodes(reachable_only=True)}
    lost = sorted({address for node, address in zip(pool.nodes, pool.addresses) if node not in alive})
    if lost:
        say(f"the {pool.name}'s node{'s' * (len(lost) > 1)} {', '.join(lost)} left the Ray cluster; waiting up to "
            f"{wait_s:.0f} s for Ray to place {'their' if len(lost) > 1 else 'its'} ranks on another node")
    deadline = time.monotonic() + wait_s
    while True:
        table = placement_group_table(pool.placement_group)
        node_of = table["bundles_to_node_id"]
        alive = {node.id: node.address for node in alive_nodes(reachable_only=True)}
        ranks = [node_of.get(pool.bundle_of(rank)) for rank in range(pool.world_size)]
        if table["state"] == "CREATED" and all(node in alive for node in ranks):
            return dataclasses.replace(pool, nodes=tuple(ranks), addresses=tuple(alive[node] for node in ranks))
        if time.monotonic() > deadline:
            raise PlacementUnsatisfiable(
                f"the {pool.name}'s node{'s' * (len(lost) > 1)} {', '.join(lost) or '?'} left the Ray cluster and no "
                f"node took {'their' if len(lost) > 1 else 'its'} place within {wait_s:.0f} s (no spare node with "
                f"{pool.per_node} {device_resource(pool.device)})")
        time.sleep(0.5)


def replace_lost_nodes(pools: Pools, say: Callable[[str], None], wait_s: float = PLACEMENT_WAIT_S) -> Pools:
    """`pools` with every node that left the cluster replaced (`replace_lost`), for the ranks' restart."""
    trainer = replace_lost(pools.trainer, wait_s, say)
    return Pools(trainer, trainer if pools.colocated else replace_lost(pools.rollout, wait_s, say))


def _remove(group) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def remove_pools(pools: Pools) -> None:
    _remove(pools.trainer.placement_group)
    if pools.rollout.placement_group is not pools.trainer.placement_group:
        _remove(pools.rollout.placement_group)
