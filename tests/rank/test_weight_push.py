"""The disaggregated push from trainer ranks on several nodes: every rank sends to its share of the servers, all at
once (rank/weight_push.sending_ranks), against the loopback SGLang stand-in. Node identity is the only thing faked:
each rank plays a node of its own on this machine (tests/launch/test_local_cluster.py runs it on real Ray nodes)."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

from rlmegatron.rank.weight_push import assign_senders, clashing_ports, sending_ranks
from rlmegatron.rollout.sglang.client import SGLangClient
from rlmegatron.transport.local_ranks import run_ranks
from tests.rollout.test_sglang import digest, make_engine

REPO_ROOT = Path(__file__).resolve().parents[2]
LOAD_S = 0.3  # each server's load of a bucket, which it answers after


def weights() -> list[tuple[str, torch.Tensor]]:
    """Three tensors of 1 MiB: three buckets of rollout.update_weights_bucket_mb=1."""
    generator = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(512, 512, generator=generator)) for i in range(3)]


def test_two_senders_of_a_node_never_keep_one_port():
    assert clashing_ports([("a", [5000, 5001]), ("b", [5000]), ("a", [5001, 5002]), ("a", [5003, 5003])]) == \
        {2: {5001}, 3: {5003}}
    assert clashing_ports([("a", [5000]), ("b", [5000])]) == {}


def test_two_ranks_of_one_node_that_draw_one_port_draw_again_and_both_push(tmp_path):
    """Both ranks of one node send (to one server each) and draw the same port for their groups: rank 1 draws again,
    and each server holds every tensor whole from its own group."""
    from rlmegatron.runtime.distributed import free_port

    (tmp_path / "port").write_text(str(free_port("")))
    engines = [make_engine(tmp_path) for _ in range(2)]
    try:
        urls = [engine.spec.url for engine in engines]
        ranks = run_ranks(_push_as_node_of_rank, 2, urls, str(tmp_path), True, timeout_s=120)
        assert [(r["servers"], r["down"]) for r in ranks] == [([0], []), ([1], [])]
        for engine in engines:
            held = SGLangClient(engine.spec.url)._call("GET", "/fake/weights")
            assert (held["version"], held["weights"]) == ("v1", {name: digest(t) for name, t in weights()})
    finally:
        for engine in engines:
            engine.shutdown()
    joined = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()
              if json.loads(line)["path"] == "/init_weights_update_group"]
    assert len({record["master_port"] for record in joined}) == 2


def test_every_rank_sends_the_nodes_first_and_engines_spread_over_the_senders_as_the_pool_changes():
    nodes = ["a", "a", "b", "b", "c", "a"]
    assert sending_ranks(nodes) == [0, 2, 4, 1, 3, 5]  # the first of every node, then the second of every node...
    assert sending_ranks(nodes, per_node=1) == [0, 2, 4]  # delta sync: one per node
    assert sending_ranks(["a"] * 4) == [0, 1, 2, 3] and sending_ranks(["a"] * 4, per_node=1) == [0]
    assigned: dict[int, int] = {}
    assign_senders([0, 1, 2, 3], [0, 2, 4], assigned)
    assert assigned == {0: 0, 1: 2, 2: 4, 3: 0}
    # The last to join leaves first, and engine numbers are never reused: the newcomers take the emptiest senders.
    del assigned[3], assigned[2]
    assign_senders([4, 5], [0, 2, 4], assigned)
    assert assigned == {0: 0, 1: 2, 4: 4, 5: 0}
    assign_senders([1], [0, 2, 4], assigned)  # a restarted server keeps its sender
    assert assigned[1] == 2
    # Two nodes of two ranks, four engines: one per rank, the nodes' first ranks first.
    assigned = {}
    assign_senders([0, 1, 2, 3], sending_ranks(["a", "a", "b", "b"]), assigned)
    assert assigned == {0: 0, 1: 2, 2: 1, 3: 3}


def _push_as_node_of_rank(urls: list[str], run_dir: str, one_node_one_port: bool = False) -> dict:
    """Rank r on node r: connect to every server, then push weights() once, the ranks starting together.
    `one_node_one_port`: both ranks on one node, each drawing the same port first for its weight-update group."""
    from rlmegatron.driver.role_settings import rollout_settings
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank import weight_push
    from rlmegatron.rank.weight_push import SyncReport, WeightPush

    rank = torch.distributed.get_rank()
    weight_push.node_id = (lambda: "node0") if one_node_one_port else (lambda: f"node{rank}")
    if one_node_one_port:
        draws, free_port = iter([int(Path(run_dir, "port").read_text())]), weight_push.free_port
        weight_push.free_port = lambda host: next(draws, None) or free_port(host)
    spec = load_spec(str(REPO_ROOT / "configs/quickstart.yaml"), [
        f"model.path={REPO_ROOT / 'configs/quickstart/model'}", "placement.nnodes=2", "placement.gpus_per_node=1",
        "placement.mode=disaggregate", "placement.rollout_nnodes=1", f"placement.rollout_gpus_per_node={len(urls)}",
        "rollout.engine=sglang", "rollout.update_weights_bucket_mb=1", f"trainer.run_dir={run_dir}"])
    push = WeightPush(rollout_settings(spec), None, None)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        push.connect([(engine, url, (("rollout-node", "cpu"),)) for engine, url in enumerate(urls)])
    torch.distributed.barrier()
    down = push._push(iter(weights()), "v1", None, SyncReport())  # the stream sync() exports, given here
    return {"down": down, "servers": sorted(push.distributed.servers) if push.distributed else [],
            "said": said.getvalue().splitlines()}


def _push_with_rank_1_failing(urls: list[str], run_dir: str) -> str:
    """As `_push_as_node_of_rank`, rank 1's push failing after its first bucket: what each rank's push raised."""
    from rlmegatron.rollout.sglang.weight_push import DistributedWeightPush

    if torch.distributed.get_rank() == 1:
        def failing(self, buckets, version, keys, down):
            next(iter(buckets))
            raise RuntimeError("rank 1's push failed after its first bucket")

        DistributedWeightPush._broadcast = failing
    try:
        _push_as_node_of_rank(urls, run_dir)
    except Exception as error:  # noqa: BLE001 - the test reads it
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_sender_that_fails_fails_the_push_on_every_rank_in_one_line_instead_of_leaving_them_waiting(tmp_path):
    """Rank 1's push raises mid-stream: it still walks the rest of the export with the others, and every rank raises
    (rank 1 its own error, the others one naming rank 1) where they used to wait in the next collective until its
    timeout."""
    engines = [make_engine(tmp_path) for _ in range(2)]
    try:
        urls = [engine.spec.url for engine in engines]
        raised = run_ranks(_push_with_rank_1_failing, 2, urls, str(tmp_path), timeout_s=120)
    finally:
        for engine in engines:
            engine.shutdown()
    assert raised == ["WeightPushFailed: the weight push failed on trainer rank 1: RuntimeError(\"rank 1's push failed "
                      "after its first bucket\")", "RuntimeError: rank 1's push failed after its first bucket"]


def test_each_node_pushes_to_its_share_of_the_servers_at_the_same_time_as_the_others(tmp_path):
    """Two trainer nodes, three servers: node 0's rank sends to servers 0 and 2, node 1's to server 1 (the only rank
    that joins a group with it), each over a weight-update group of its own, and all three take the first bucket at
    once. Server 1 dies as its second bucket is announced: every rank's report names it (rank 0's goes to the
    driver), and the other two hold every tensor whole. Rank 0 says who sends to whom."""
    engines = [make_engine(tmp_path, **{"fake-load-s": LOAD_S, **({"fake-die-on-push": 2} if key == 1 else {})})
               for key in range(3)]
    try:
        urls = [engine.spec.url for engine in engines]
        ranks = run_ranks(_push_as_node_of_rank, 2, urls, str(tmp_path), timeout_s=120)
        assert [(r["servers"], r["down"]) for r in ranks] == [([0, 2], [1]), ([1], [1])]
        assert not engines[1].client.health()  # it did die
        for engine in (engines[0], engines[2]):
            held = SGLangClient(engine.spec.url)._call("GET", "/fake/weights")
            assert held["version"] == "v1"
            assert held["weights"] == {name: digest(tensor) for name, tensor in weights()}
    finally:
        for engine in engines:
            engine.shutdown()
    records = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    by_pid = {}
    for record in records:
        by_pid.setdefault(record["pid"], []).append(record)
    pid_of = {}  # each server's process, by the group it joined
    for pid, lives in by_pid.items():
        (init,) = [r for r in lives if r["path"] == "/init_weights_update_group"]
        pid_of[int(init["group_name"].split("_")[2])] = pid
    buckets = {engine: [r for r in by_pid[pid_of[engine]] if r["path"] == "/update_weights_from_distributed"]
               for engine in range(3)}
    assert (len(buckets[0]), len(buckets[1]), len(buckets[2])) == (3, 1, 3)
    # Every server took the first bucket while the others were loading theirs: two senders at once, each to all its
    # servers at once.
    assert max(buckets[e][0]["started"] for e in range(3)) < min(buckets[e][0]["ended"] for e in range(3))
    assert [r["said"] for r in ranks] == [
        ["weight sync: engines 0, 2 from trainer rank 0 (127.0.0.1); engine 1 from trainer rank 1 (127.0.0.1)"], []]
