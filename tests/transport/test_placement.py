"""The placement section sizes what Ray is asked for: the local cluster, and one bundle per node spread over distinct
nodes (Ray's own calls are recorded, not made, here; tests/launch/test_local_cluster.py places on a real cluster)."""
import importlib
import socket
from pathlib import Path

import pytest

from rlmegatron.prelaunch.spec_pipeline import load_spec
from rlmegatron.transport.placement import (Ask, Node, PlacementUnsatisfiable, ResourcePool, can_hold, create_pools,
                                            missing)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _nodes(*cpus: int) -> list[Node]:
    return [Node(f"node{i}", f"127.0.0.{i + 2}", {"CPU": float(n)}) for i, n in enumerate(cpus)]


def test_a_node_serves_one_bundle_and_the_biggest_asks_are_matched_first():
    trainer, rollout = Ask("trainer", 2, 2, ""), Ask("rollout pool", 1, 1, "")
    assert can_hold(_nodes(2, 2, 1), "cpu", [trainer, rollout])
    assert can_hold(_nodes(2, 2, 2), "cpu", [rollout, trainer])  # the order the asks come in does not matter
    assert not can_hold(_nodes(2, 1, 1), "cpu", [trainer, rollout])  # one node big enough for the trainer's bundles
    assert not can_hold(_nodes(2, 2), "cpu", [trainer, rollout])  # nodes enough for each, not for both
    assert can_hold(_nodes(2, 2), "cpu", [trainer]) and can_hold(_nodes(2, 2), "cpu", [rollout])
    # A GPU rank's bundle also holds a CPU for its process.
    gpu_node = [Node("g", "10.0.0.1", {"GPU": 8.0, "CPU": 4.0})]
    assert can_hold(gpu_node, "cuda", [Ask("trainer", 1, 4, "")]) and not can_hold(gpu_node, "cuda",
                                                                                   [Ask("trainer", 1, 8, "")])


def test_what_the_cluster_lacks_is_said_with_the_fields_that_ask_it():
    ask = Ask("trainer", 2, 2, "placement.nnodes=2 x placement.gpus_per_node=2")
    assert missing(_nodes(2, 2), "cpu", ask) is None
    assert missing(_nodes(2, 1), "cpu", ask) == (
        "the trainer needs 2 nodes with 2 CPU each (placement.nnodes=2 x placement.gpus_per_node=2), and the Ray "
        "cluster has 1 such node (alive nodes: 127.0.0.2 (2 CPU), 127.0.0.3 (1 CPU))")


@pytest.fixture
def recorded_ray(monkeypatch):
    """Ray's calls recorded: a cluster of the nodes the test sets in `asked["nodes"]`; placement groups are placed
    bundle i on node i, as STRICT_SPREAD places them on a cluster of that many nodes."""
    import ray

    placement_groups = importlib.import_module("ray.util.placement_group")  # the module, not its function
    asked: dict = {"groups": []}

    class Group:
        def __init__(self, bundles):
            self.bundles = bundles

        def wait(self, timeout_s):
            return asked.get("placed", True)

    def placement_group(bundles, strategy, name):
        asked["groups"].append((name, bundles, strategy))
        return Group(bundles)

    # Each node's raylet is a real listening socket on the node's address (replace_lost connects to it).
    raylets = asked["raylets"] = {}

    def raylet_port(address: str) -> int:
        if address not in raylets:
            listener = socket.create_server((address, 0))
            raylets[address] = (listener, listener.getsockname()[1])
        return raylets[address][1]

    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n.id, "NodeManagerAddress": n.address, "Alive": True,
                                                "NodeManagerPort": raylet_port(n.address), "Resources": n.resources}
                                               for n in asked["nodes"]])
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0})
    monkeypatch.setattr(placement_groups, "placement_group", placement_group)
    monkeypatch.setattr(placement_groups, "remove_placement_group", lambda group: asked.setdefault("removed", group))
    monkeypatch.setattr(placement_groups, "placement_group_table", lambda group: {
        "bundles_to_node_id": {index: asked["nodes"][index].id for index in range(len(group.bundles))}})
    yield asked
    for listener, _ in raylets.values():
        listener.close()


def _placement(*overrides: str):
    return load_spec(str(REPO_ROOT / "configs" / "quickstart.yaml"), [
        "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "actor.ppo_micro_batch_size_per_gpu=8",
        *overrides]).placement


def test_each_node_gets_one_bundle_of_its_ranks_and_no_two_share_a_node(recorded_ray):
    recorded_ray["nodes"] = _nodes(3, 3, 3)
    pools = create_pools(_placement("placement.nnodes=2", "placement.gpus_per_node=3"))
    assert recorded_ray["groups"] == [("trainer", [{"CPU": 3}, {"CPU": 3}], "STRICT_SPREAD")]
    trainer = pools.trainer
    assert pools.colocated and trainer.world_size == 6
    assert trainer.nodes == ("node0",) * 3 + ("node1",) * 3
    assert trainer.addresses == ("127.0.0.2",) * 3 + ("127.0.0.3",) * 3
    assert [trainer.bundle_of(rank) for rank in range(6)] == [0, 0, 0, 1, 1, 1]
    assert trainer.describe() == "6 ranks on 2 nodes: 127.0.0.2 (ranks 0-2), 127.0.0.3 (ranks 3-5)"


def test_the_rollout_pool_takes_nodes_of_its_own_when_the_cluster_has_them(recorded_ray):
    disaggregated = ("placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1",
                     "placement.nnodes=2", "placement.gpus_per_node=1")
    recorded_ray["nodes"] = _nodes(2, 2, 2)
    pools = create_pools(_placement(*disaggregated))
    assert recorded_ray["groups"] == [("trainer+rollout", [{"CPU": 1}] * 3, "STRICT_SPREAD")]
    assert pools.trainer.nodes == ("node0", "node1") and pools.rollout.nodes == ("node2",)
    assert pools.rollout.bundle_of(0) == 2
    # Two nodes: each pool spread over its own, the rollout pool beside a trainer rank.
    recorded_ray["nodes"], recorded_ray["groups"] = _nodes(2, 2), []
    pools = create_pools(_placement(*disaggregated))
    assert recorded_ray["groups"] == [("trainer", [{"CPU": 1}] * 2, "STRICT_SPREAD"),
                                      ("rollout", [{"CPU": 1}], "STRICT_PACK")]
    assert pools.rollout.bundle_of(0) == 0


def test_a_cluster_too_small_is_refused_at_once_and_a_busy_one_after_the_wait(recorded_ray):
    recorded_ray["nodes"] = _nodes(2)
    with pytest.raises(PlacementUnsatisfiable, match=r"^placement: the trainer needs 2 nodes with 1 CPU each "
                                                     r"\(placement.nnodes=2 x placement.gpus_per_node=1\), and the "
                                                     r"Ray cluster has 1 such node"):
        create_pools(_placement("placement.nnodes=2", "placement.gpus_per_node=1"))
    assert recorded_ray["groups"] == []  # nothing was asked of Ray
    recorded_ray["nodes"], recorded_ray["placed"] = _nodes(2, 2), False
    with pytest.raises(PlacementUnsatisfiable, match="did not free them within 0 s: other work holds them"):
        create_pools(_placement("placement.nnodes=2", "placement.gpus_per_node=1"), wait_s=0)
    assert "removed" in recorded_ray  # the group asked for is not left pending


def test_a_local_cluster_is_sized_for_the_placement(monkeypatch):
    import ray

    from rlmegatron.driver import job

    asked = {}

    class Context:
        address_info = {"session_dir": "/tmp/ray/session_test"}

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: asked.setdefault("init", kwargs) and Context())
    # The reaper of the session rlm train starts is tested in tests/supervision/test_reaper.py; nothing starts here.
    reaper = importlib.import_module("rlmegatron.supervision.reaper")
    monkeypatch.setattr(reaper, "start", lambda mark, session_dir: None)
    monkeypatch.setattr(reaper, "mark_started_processes", lambda: "mark")
    job.start_ray(load_spec(str(REPO_ROOT / "configs" / "quickstart.yaml"), [
        "placement.nnodes=2", "placement.gpus_per_node=3", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6",
        "actor.ppo_micro_batch_size_per_gpu=8"]))
    assert asked["init"]["num_cpus"] == 6  # 2 nodes x 3 CPU ranks
    # The ranks inherit the driver's PYTHONPATH from the processes ray.init starts, not through a job runtime_env.
    assert "runtime_env" not in asked["init"]


def test_a_pool_describes_where_its_ranks_are():
    pool = ResourcePool("trainer", None, 0, 1, "cpu", ("a", "b"), ("10.0.0.1", "10.0.0.2"))
    assert pool.describe() == "2 ranks on 2 nodes: 10.0.0.1 (rank 0), 10.0.0.2 (rank 1)"


def test_a_lost_nodes_ranks_wait_for_ray_to_place_them_again_within_a_bound(recorded_ray, monkeypatch):
    import importlib

    from rlmegatron.transport.placement import replace_lost

    placement_groups = importlib.import_module("ray.util.placement_group")
    recorded_ray["nodes"] = _nodes(2, 2, 2)
    pool = create_pools(_placement("placement.nnodes=2", "placement.gpus_per_node=1")).trainer
    assert pool.addresses == ("127.0.0.2", "127.0.0.3")
    said = []
    # Node 1 left; Ray placed its bundle on node 2, the spare.
    recorded_ray["nodes"] = [recorded_ray["nodes"][0], recorded_ray["nodes"][2]]
    monkeypatch.setattr(placement_groups, "placement_group_table", lambda group: {
        "state": "CREATED", "bundles_to_node_id": {0: "node0", 1: "node2"}})
    again = replace_lost(pool, 0, said.append)
    assert again.addresses == ("127.0.0.2", "127.0.0.4") and again.nodes == ("node0", "node2")
    assert said == ["the trainer's node 127.0.0.3 left the Ray cluster; waiting up to 0 s for Ray to place its ranks "
                    "on another node"]
    # No spare: the bundle stays unplaced, and the wait ends in one line naming the node.
    monkeypatch.setattr(placement_groups, "placement_group_table", lambda group: {
        "state": "RESCHEDULING", "bundles_to_node_id": {0: "node0"}})
    with pytest.raises(PlacementUnsatisfiable, match=r"^the trainer's node 127.0.0.3 left the Ray cluster and no node "
                                                     r"took its place within 0 s \(no spare node with 1 CPU\)$"):
        replace_lost(pool, 0)
    # Every node alive and the group placed (a rank's process died, not its node): at once, nothing said.
    recorded_ray["nodes"] = _nodes(2, 2, 2)
    monkeypatch.setattr(placement_groups, "placement_group_table", lambda group: {
        "state": "CREATED", "bundles_to_node_id": {0: "node0", 1: "node1"}})
    said.clear()
    assert replace_lost(pool, 0, said.append) == pool and said == []


def test_a_node_whose_raylet_is_gone_counts_as_lost_before_the_gcs_says_so(recorded_ray, monkeypatch):
    from rlmegatron.transport.placement import replace_lost

    placement_groups = importlib.import_module("ray.util.placement_group")
    recorded_ray["nodes"] = _nodes(2, 2, 2)
    pool = create_pools(_placement("placement.nnodes=2", "placement.gpus_per_node=1")).trainer
    # Node 1's raylet was killed: the GCS still counts it alive and its bundle is still placed there.
    recorded_ray["raylets"]["127.0.0.3"][0].close()
    monkeypatch.setattr(placement_groups, "placement_group_table", lambda group: {
        "state": "CREATED", "bundles_to_node_id": {0: "node0", 1: "node1"}})
    said = []
    with pytest.raises(PlacementUnsatisfiable, match=r"^the trainer's node 127.0.0.3 left the Ray cluster and no node "
                                                     r"took its place"):
        replace_lost(pool, 0, said.append)
    assert said == ["the trainer's node 127.0.0.3 left the Ray cluster; waiting up to 0 s for Ray to place its ranks "
                    "on another node"]
    # Once the GCS has moved the bundle to the spare, the ranks go there.
    monkeypatch.setattr(placement_groups, "placement_group_table", lambda group: {
        "state": "CREATED", "bundles_to_node_id": {0: "node0", 1: "node2"}})
    assert replace_lost(pool, 0).addresses == ("127.0.0.2", "127.0.0.4")
