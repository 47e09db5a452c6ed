"""Resource pools as Ray placement groups: one bundle per GPU (or CPU rank), sorted by node; colocated or disaggregated."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmegatron.config.spec import PlacementConfig


@dataclass(frozen=True)
class ResourcePool:
    """A placement group and its bundle indices in rank order (by node, then bundle position on it)."""

    name: str
    placement_group: object
    bundle_order: tuple[int, ...]
    device: str
    nodes: tuple[str, ...]
    """The Ray node id of each rank's bundle, in rank order."""

    @property
    def world_size(self) -> int:
        return len(self.bundle_order)

    def bundle_resources(self) -> dict[str, float]:
        return {"GPU": 1} if self.device == "cuda" else {"CPU": 1}


@dataclass(frozen=True)
class Pools:
    trainer: ResourcePool
    rollout: ResourcePool
    """The trainer's own pool when colocated: engines live in the trainer ranks and release memory while they train."""

    @property
    def colocated(self) -> bool:
        return self.rollout is self.trainer


def bundle(device: str) -> dict[str, float]:
    # On GPU a rank also needs a CPU for its Python process; on CPU the CPU is the device.
    return {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}


def create_pool(name: str, nnodes: int, per_node: int, device: str, timeout_s: float = 300.0) -> ResourcePool:
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    group = placement_group([bundle(device)] * (nnodes * per_node), strategy="PACK", name=name)
    if not group.wait(timeout_s):
        raise RuntimeError(
            f"placement group {name!r} ({nnodes}x{per_node} {device} bundles) was not scheduled in {timeout_s:.0f}s; "
            f"cluster resources: {ray.cluster_resources()}"
        )
    node_of = placement_group_table(group)["bundles_to_node_id"]
    # Ranks of one node stay contiguous, so TP groups (innermost in Megatron's order) never span nodes.
    order = tuple(sorted(node_of, key=lambda index: (node_of[index], index)))
    return ResourcePool(name, group, order, device, tuple(node_of[index] for index in order))


def create_pools(placement: PlacementConfig) -> Pools:
    trainer = create_pool("trainer", placement.nnodes, placement.gpus_per_node, placement.device)
    if placement.mode == "colocate":
        return Pools(trainer, trainer)
    rollout = create_pool("rollout", placement.rollout_nnodes, placement.rollout_gpus_per_node, placement.device)
    return Pools(trainer, rollout)


def remove_pools(pools: Pools) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pools.trainer.placement_group)
    if not pools.colocated:
        remove_placement_group(pools.rollout.placement_group)
