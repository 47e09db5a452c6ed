"""The placement section sizes what Ray is asked for: the local cluster and the trainer's placement group (Ray's own
calls are recorded, not made)."""
from pathlib import Path

from rlmegatron.spec_pipeline import load_spec

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_trainer_pool_spans_every_node(monkeypatch):
    import importlib

    import ray

    from rlmegatron.driver import job
    from rlmegatron.transport.placement import create_pools

    # ray.util's placement_group function hides the module of that name from `import ... as`.
    placement_groups = importlib.import_module("ray.util.placement_group")
    asked = {}

    class Group:
        def wait(self, timeout_s):
            return True

    def placement_group(bundles, strategy, name):
        asked[name] = bundles
        return Group()

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    class Context:
        address_info = {"session_dir": "/tmp/ray/session_test"}

    monkeypatch.setattr(ray, "init", lambda **kwargs: asked.setdefault("init", kwargs) and Context())
    # The reaper of the session rlm train starts is tested in tests/test_reaper.py; nothing starts here.
    reaper = importlib.import_module("rlmegatron.reaper")
    monkeypatch.setattr(reaper, "start", lambda mark, session_dir: asked.setdefault("reaper", session_dir))
    monkeypatch.setattr(reaper, "mark_started_processes", lambda: "mark")
    monkeypatch.setattr(placement_groups, "placement_group", placement_group)
    monkeypatch.setattr(placement_groups, "placement_group_table", lambda group: {
        "bundles_to_node_id": {index: f"node{index // 3}" for index in range(len(asked["trainer"]))}})
    spec = load_spec(str(REPO_ROOT / "configs" / "quickstart.yaml"), [
        "placement.nnodes=2", "placement.gpus_per_node=3", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6",
        "actor.ppo_micro_batch_size_per_gpu=8"])
    job.start_ray(spec)
    pools = create_pools(spec.placement)
    assert asked["init"]["num_cpus"] == 6  # 2 nodes x 3 CPU ranks
    assert asked["trainer"] == [{"CPU": 1}] * 6
    assert pools.colocated and pools.trainer.world_size == 6
    # Each rank's node, in rank order: rank 0's says where the rendezvous is (this node: no probe).
    assert pools.trainer.nodes == ("node0",) * 3 + ("node1",) * 3
    # The ranks inherit the driver's PYTHONPATH from the processes ray.init starts, not through a job runtime_env.
    assert "runtime_env" not in asked["init"]
