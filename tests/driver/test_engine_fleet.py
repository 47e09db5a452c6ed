"""Where SGLang servers sit: engines over whole nodes, and a colocated server spanning two nodes run for real
against the loopback SGLang stand-in (node identity is the only thing faked: both "nodes" are this machine)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlmegatron.driver import engine_fleet
from rlmegatron.rank.weight_push import SyncReport
from rlmegatron.pool import engine_host
from rlmegatron.rollout.sglang import servers
from rlmegatron.rank import colocated_engine
from rlmegatron.rollout.sglang.servers import Place, server_nodes
from rlmegatron.driver.role_settings import rollout_settings
from rlmegatron.rollout.sglang.client import ServerUnavailable
from rlmegatron.runtime.distributed import free_port
from rlmegatron.transport.local_ranks import run_ranks
from tests.rollout.test_sglang import digest

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_SGLANG = REPO_ROOT / "tests" / "rollout" / "fake_sglang"


def places(per_node: list[int]) -> list[Place]:
    return [Place(f"n{node}", str(gpu), f"10.0.0.{node}", 5000 + node)
            for node, count in enumerate(per_node) for gpu in range(count)]


def test_engines_take_whole_nodes_and_rendezvous_at_their_first_node():
    layout = server_nodes(places([2, 2, 2, 2]), tp=4, engines=2)
    assert [[(n.node_rank, n.nnodes, n.slots, n.dist_init_addr) for n in nodes] for nodes in layout] == [
        [(0, 2, (0, 1), "10.0.0.0:5000"), (1, 2, (2, 3), "10.0.0.0:5000")],
        [(0, 2, (4, 5), "10.0.0.2:5002"), (1, 2, (6, 7), "10.0.0.2:5002")],
    ]
    within = server_nodes(places([4, 4]), tp=2, engines=4)
    assert [(n.engine, n.nnodes, n.slots, n.dist_init_addr) for nodes in within for n in nodes] == [
        (0, 1, (0, 1), None), (1, 1, (2, 3), None), (2, 1, (4, 5), None), (3, 1, (6, 7), None)]


def test_an_engine_over_unequal_parts_of_nodes_is_refused():
    with pytest.raises(RuntimeError, match=r"engine 0 would take \[3, 1\] GPUs on nodes \['n0', 'n1'\]"):
        server_nodes(places([3, 3]), tp=4, engines=1)


def test_a_server_on_trainer_rank_0s_own_gpu_gets_its_weights_over_gloo(monkeypatch):
    """NCCL refuses a group with two ranks on one GPU ("Duplicate GPU detected"): one GPU split between the trainer
    and a disaggregated engine (a run without Ray) takes gloo, which stages CUDA tensors through the host; a server
    with no rank on rank 0's GPU takes NCCL; on CPU it is gloo."""
    import socket

    monkeypatch.setattr(servers, "device_id", lambda device: "3" if device == "cuda" else "cpu")
    here = socket.gethostname()
    assert servers.weight_group_backend("cuda", ((here, "3"),)) == "gloo"
    assert servers.weight_group_backend("cuda", ((here, "2"), (here, "3"))) == "gloo"  # one TP rank shares it
    assert servers.weight_group_backend("cuda", ((here, "2"),)) == "nccl"
    assert servers.weight_group_backend("cuda", (("another-node", "3"),)) == "nccl"  # GPU 3 of another node
    assert servers.weight_group_backend("cpu", ((here, "cpu"),)) == "gloo"


def weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.mlp.up_proj.weight", scale * torch.randn(64, 32, generator=generator))
            for i in range(6)]


def _serve_across_two_nodes(calls: str, run_dir: str) -> dict:
    """Rank r plays node r: rank 0 leads the server (node 0, HTTP), rank 1 runs node 1's process."""
    from transformers import AutoConfig

    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank.colocated_engine import ColocatedEngine
    from rlmegatron.rollout.sglang.servers import generate_or_none
    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
    from rlmegatron.rollout.sglang.client import SGLangClient

    rank = torch.distributed.get_rank()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)])
    colocated_engine.this_place = lambda device: Place(f"node{rank}", "cpu", "127.0.0.1", free_port(""))
    spec = load_spec(str(REPO_ROOT / "configs/quickstart.yaml"), [
        f"model.path={REPO_ROOT / 'configs/quickstart/model'}", "placement.nnodes=2", "placement.gpus_per_node=1",
        "rollout.engine=sglang", "rollout.tensor_parallel_size=2", "rollout.update_weights_bucket_mb=1",
        f"rollout.sglang.python={sys.executable}", "rollout.sglang.startup_timeout_s=60",
        f"rollout.sglang.extra_args.fake-record={calls}", f"trainer.run_dir={run_dir}"])
    colocated = ColocatedEngine(rollout_settings(spec), AutoConfig.from_pretrained(spec.model.path))
    index, engine = colocated.index, colocated.part
    requests = [GenerationRequest((1, 2, 3), SamplingSpec(n=2, max_new_tokens=3))]
    seen = {"index": index, "kind": type(engine).__name__}

    engine.update_weights(iter(weights(1.0)), "v1")
    if rank == 0:
        seen["before"] = [r.weight_version for r in generate_or_none(engine, requests)]
    torch.distributed.barrier()
    if rank == 1:
        engine.node_process.stop()  # node 1 is lost; node 0 goes down with it
    torch.distributed.barrier()
    if rank == 0:
        deadline = time.monotonic() + 30
        while engine.process.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        seen["after_loss"] = generate_or_none(engine, requests)
        seen["stale"] = engine.stale
    torch.distributed.barrier()
    engine.relaunch()  # what a sync for a restarted engine does, on every rank of its group
    engine.update_weights(iter(weights(2.0)), "v2")
    if rank == 0:
        seen["again"] = [r.weight_version for r in generate_or_none(engine, requests)]
        seen["restarts"] = engine.restarts
        seen["pushed"] = SGLangClient(engine.spec.url)._call("GET", "/fake/weights")
    torch.distributed.barrier()
    engine.shutdown()
    return seen


def test_a_colocated_server_spans_two_nodes_gets_each_ranks_buckets_and_restarts_whole(tmp_path):
    calls = tmp_path / "calls.jsonl"
    leader, member = run_ranks(_serve_across_two_nodes, 2, str(calls), str(tmp_path), timeout_s=240)
    assert (leader["index"], leader["kind"], member["index"], member["kind"]) == (0, "SGLangEngine", 0, "EngineMember")
    assert leader["before"] == ["v1", "v1"]
    # Losing node 1 takes the server down; the engine waits for the caller to restart every node and resync.
    assert leader["after_loss"] is None and leader["stale"] and leader["restarts"] == 1
    assert leader["again"] == ["v2", "v2"]
    assert leader["pushed"] == {"version": "v2", "weights": {name: digest(t) for name, t in weights(2.0)}}

    records = [json.loads(line) for line in calls.read_text().splitlines()]
    lives = list(dict.fromkeys(r["pid"] for r in records))
    assert len(lives) == 2
    for pid, scale, version in zip(lives, (1.0, 2.0), ("v1", "v2")):
        life = [r for r in records if r["pid"] == pid]
        assert life[0] == {"pid": pid, "path": "/fake/nodes_joined", "nnodes": 2}
        updates = [r for r in life if r["path"] == "/update_weights_from_tensor"]
        # Every bucket came as two handles, one from each rank, so each TP rank reads memory on its own node.
        assert updates and all(r["distinct_payloads"] == 2 for r in updates)
        assert [n for r in updates for n in r["names"]] == [name for name, _ in weights(scale)]
    assert "/generate" in [r["path"] for r in records if r["pid"] == lives[1]]


class RecordingTrainer:
    """The trainer ranks as the engine fleet on a rollout pool addresses them (driver.trainer_client.TrainerClient); the weight
    groups themselves are tested with DistributedWeightPush in tests/rollout/test_sglang.py."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.owner = threading.RLock()

    def connect_engines(self, endpoints) -> None:
        self.calls.append(("connect_engines", endpoints))

    def sync_weights(self, version, engines=None, fresh=False) -> SyncReport:
        self.calls.append(("sync_weights", version, engines, fresh))
        return SyncReport(full=fresh)  # no server went down during the push


def test_a_disaggregated_server_spans_two_nodes_and_restarts_every_node(tmp_path, monkeypatch):
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.driver.engine_fleet import EngineFleet, OnRolloutPool
    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)]))
    hosts = iter(range(2))  # the pool's two hosts, one per "node"
    monkeypatch.setattr(engine_host, "this_place", lambda device: Place(f"node{next(hosts)}", "cpu", "127.0.0.1",
                                                                    free_port("")))
    calls = tmp_path / "calls.jsonl"
    spec = load_spec(str(REPO_ROOT / "configs/quickstart.yaml"), [
        f"model.path={REPO_ROOT / 'configs/quickstart/model'}", "placement.gpus_per_node=1",
        "placement.mode=disaggregate", "placement.rollout_nnodes=2", "placement.rollout_gpus_per_node=1",
        "rollout.engine=sglang", "rollout.tensor_parallel_size=2", f"rollout.sglang.python={sys.executable}",
        "rollout.sglang.startup_timeout_s=60", f"rollout.sglang.extra_args.fake-record={calls}",
        f"trainer.run_dir={tmp_path}"])
    trainer = RecordingTrainer()
    fleet = EngineFleet(OnRolloutPool(rollout_settings(spec), trainer))
    pool = fleet.backend
    try:
        assert pool.count == 1 and len(pool.hosts) == 2 and pool.hosts[1].node_process.alive
        # Rank 0 learns where the server's two TP ranks sit (node, device): its group's backend follows from it.
        server = (("node0", "cpu"), ("node1", "cpu"))
        fleet.sync("v1")
        assert trainer.calls == [("connect_engines", [(0, pool.urls[0], server)]), ("sync_weights", "init", [0], True),
                                 ("sync_weights", "v1", [0], False)]
        pool.hosts[1].node_process.stop()
        deadline = time.monotonic() + 30
        while pool.hosts[pool.leaders[0]].engine.process.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        # The server restarts inside the generation and holds no weights: the fleet restarts its other node, has rank
        # 0 join a new group with it, pushes it the latest weights whole, and sends the request again.
        [result] = fleet.generate([GenerationRequest((1, 2), SamplingSpec(max_new_tokens=2))])
        assert len(result.output_token_ids) == 2 and fleet.versions == {0: "v1"}
        assert trainer.calls[3:] == [("connect_engines", [(0, pool.urls[0], server)]),
                                     ("sync_weights", "v1", [0], True)]
    finally:
        fleet.shutdown()
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    # Each push held the server's generation (the stand-in trainer pushes nothing): the initial one and v1, then the
    # server's second life.
    assert [r["path"] for r in records] == ["/fake/nodes_joined", *["/pause_generation", "/continue_generation"] * 2,
                                            "/fake/nodes_joined", "/generate"]


def test_the_servers_run_the_models_own_code_only_with_trust_remote_code(monkeypatch):
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rollout.sglang.server import server_command

    monkeypatch.chdir(REPO_ROOT)
    node = servers.ServerNode(engine=0, node_rank=0, nnodes=1, slots=(0,), dist_init_addr=None)
    for trust in (False, True):
        spec = load_spec("configs/quickstart.yaml", ["rollout.engine=sglang", "placement.device=cuda",
                                                     f"model.trust_remote_code={str(trust).lower()}"])
        command = server_command(servers.launch_spec(rollout_settings(spec), ["0"], "127.0.0.1", node))
        assert ("--trust-remote-code" in command) == trust


# --- engines built from the spec's rollout settings ---------------------------------------------------------------

def sglang_spec(tmp_path: Path, *overrides: str):
    from rlmegatron.prelaunch.spec_pipeline import load_spec

    return load_spec(str(REPO_ROOT / "configs/quickstart.yaml"), [
        f"model.path={REPO_ROOT / 'configs/quickstart/model'}", "placement.gpus_per_node=1", "rollout.engine=sglang",
        f"rollout.sglang.python={sys.executable}", f"rollout.sglang.extra_args.fake-record={tmp_path / 'calls.jsonl'}",
        f"trainer.run_dir={tmp_path}", *overrides])


def spec_built_engine(spec):
    """What a colocated rank leading a one-GPU engine builds from the spec."""
    from transformers import AutoConfig

    settings = rollout_settings(spec)
    return servers.sglang_engine(settings, servers.launch_spec(settings, ["cpu"], "127.0.0.1", server_nodes(
        places([1]), tp=1, engines=1)[0][0]), AutoConfig.from_pretrained(spec.model.path))


def test_the_server_command_serves_model_dtype(tmp_path):
    from rlmegatron.rollout.sglang.server import server_command

    spec = sglang_spec(tmp_path, "model.dtype=fp16", "placement.device=cuda")
    node = server_nodes(places([1]), tp=1, engines=1)[0][0]
    assert "--dtype float16" in " ".join(server_command(servers.launch_spec(rollout_settings(spec), ["0"], "127.0.0.1",
                                                                            node)))


def test_a_spec_built_engine_sends_buckets_of_the_spec_size_and_joins_the_routers_it_names(tmp_path, monkeypatch):
    from rlmegatron.rollout.sglang.client import RouterClient
    from tests.rollout.test_sglang import start_router

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)]))
    router, url = start_router(tmp_path)
    spec = sglang_spec(tmp_path, "rollout.update_weights_bucket_mb=1", f"rollout.sglang.router_url={url}",
                       "rollout.sglang.startup_timeout_s=60")
    engine = spec_built_engine(spec)
    try:
        # 3 MiB of fp32 weights in 512 KiB tensors: three 1 MiB buckets (the default 512 MiB would take one).
        generator = torch.Generator().manual_seed(0)
        big = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(256, 512, generator=generator)) for i in range(6)]
        engine.update_weights(iter(big), "v1")
        assert RouterClient(url).workers() == [engine.spec.url]
    finally:
        engine.shutdown()
        router.stop()
    records = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    updates = [r["names"] for r in records if r["path"] == "/update_weights_from_tensor"]
    assert updates == [[name for name, _ in big[i : i + 2]] for i in (0, 2, 4)]


def test_a_server_slower_than_the_startup_timeout_fails_the_start_and_is_stopped(tmp_path, monkeypatch):
    from rlmegatron.rollout.sglang.server import ServerStartupError

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)]))
    spec = sglang_spec(tmp_path, "rollout.sglang.startup_timeout_s=1", "rollout.sglang.extra_args.fake-slow-start=60")
    started = time.monotonic()
    with pytest.raises(ServerStartupError, match="not healthy after 1s") as failure:
        spec_built_engine(spec)
    assert time.monotonic() - started < 30
    assert "--fake-slow-start 60" in str(failure.value)
    assert servers_recording_to(tmp_path / "calls.jsonl") == [], "the server that never became healthy still runs"


def servers_recording_to(calls: Path) -> list[str]:
    """Live processes (not zombies) whose command line names `calls`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and str(calls).encode() in (proc / "cmdline").read_bytes()
                    and "zombie" not in (proc / "status").read_text()):
                found.append(proc.name)
        except OSError:
            pass
    return found


class ServerlessHost(engine_host.EngineHost):
    """A rollout-pool host on one node whose launch is answered with a URL: no server starts. It records what the
    driver asks of it in `events`; every server takes the weights."""

    events: list = []

    def place(self):
        return Place("n0", "cpu", "127.0.0.1", 5000)

    def launch(self, devices, node):
        self.index = node.engine
        return f"http://server-{node.engine}"

    def takes_weights(self):
        return True

    def weights_pushed(self, version):
        self.events.append(("pushed", self.index, version))


def test_without_ray_the_engine_process_gets_the_trainers_own_gpu_and_the_push_takes_gloo(tmp_path, monkeypatch):
    """One GPU split between trainer and engine (run_training(use_ray=False), disaggregated): the pool's host lives in
    the trainer's process, so its place is the trainer's GPU; the server process is launched on that GPU, and rank 0
    learns it shares the device, for which it takes gloo (NCCL refuses two ranks on one GPU)."""
    import socket
    from types import SimpleNamespace

    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.driver.engine_fleet import OnRolloutPool

    monkeypatch.setattr(servers, "device_id", lambda device: "3")  # this process's GPU, as CUDA_VISIBLE_DEVICES says
    launched = []

    def server_of(settings, server, hf_config):  # the launch spec, not a server
        launched.append(server)
        return SimpleNamespace(spec=server, stale=False, health=lambda: True, mark_synced=lambda version: None)

    monkeypatch.setattr(engine_host, "sglang_engine", server_of)
    spec = load_spec(str(REPO_ROOT / "configs/quickstart.yaml"), [
        "placement.device=cuda", "placement.gpus_per_node=1", "placement.mode=disaggregate",
        "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1", f"trainer.run_dir={tmp_path}"])
    trainer = RecordingTrainer()
    OnRolloutPool(rollout_settings(spec), trainer)
    (server,) = launched
    assert server.env == {"CUDA_VISIBLE_DEVICES": "3"} and server.module == "rlmegatron.rollout.local_server"
    (endpoint,) = trainer.calls[0][1]
    assert endpoint == (0, server.url, ((socket.gethostname(), "3"),))
    assert servers.weight_group_backend("cuda", endpoint[2]) == "gloo"


def test_rollout_num_gpus_sizes_the_engine_pool(tmp_path, monkeypatch):
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.driver.engine_fleet import OnRolloutPool

    monkeypatch.setattr(engine_fleet, "EngineHost", ServerlessHost)
    disaggregated = [f"model.path={REPO_ROOT / 'configs/quickstart/model'}", "placement.gpus_per_node=1",
                     "placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=2",
                     "rollout.engine=sglang", f"trainer.run_dir={tmp_path}"]
    for overrides, count in (([], 2), (["rollout.num_gpus=1"], 1)):
        pool = OnRolloutPool(rollout_settings(load_spec(str(REPO_ROOT / "configs/quickstart.yaml"),
                                                        disaggregated + overrides)), RecordingTrainer())
        assert (len(pool.hosts), pool.count, pool.urls) == (count, count, [f"http://server-{e}" for e in range(count)])


@pytest.mark.parametrize("partial", [True, False])
def test_a_push_to_every_engine_leaves_out_a_server_that_is_down_or_restarted(tmp_path, monkeypatch, partial):
    """one_step_off and async generate beside the push: a server may have died under that generation (its pause
    fails), or been restarted by it and wait, outside the trainer's weight-update group, for the push to it alone.
    The push to every engine must leave such a server out (a collective push to a dead peer fails or hangs); every
    server paused is continued, and only those pushed to are marked as holding the version."""
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.driver.engine_fleet import EngineFleet, OnRolloutPool
    from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, SamplingSpec

    events, restarts, gone = [], [], set()

    class Host(ServerlessHost):
        """Engine 0 serves (until it is `gone`); engine 1 is down (its pause fails), engine 2 restarted (up, but
        stale); a generation on engine 2 restarts it once per entry of `restarts`."""

        def pause_generation(self):
            events.append(("pause", self.index))
            return self.index != 1

        def continue_generation(self):
            events.append(("continue", self.index))

        def takes_weights(self):
            return self.index == 0 and self.index not in gone

        def relaunch(self):
            events.append(("relaunch", self.index))

        def generate(self, requests, progress=None):
            if self.index == 2 and restarts:
                restarts.pop()
                return None
            return [GenerationResult(i, 0, (7,), (-0.5,), "length", None) for i in range(len(requests))]

    monkeypatch.setattr(engine_fleet, "EngineHost", Host)
    monkeypatch.setattr(Host, "events", events)
    spec = load_spec(str(REPO_ROOT / "configs/quickstart.yaml"), [
        f"model.path={REPO_ROOT / 'configs/quickstart/model'}", "placement.gpus_per_node=1",
        "placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=3",
        "rollout.engine=sglang", f"trainer.run_dir={tmp_path}", "trainer.mode=async",
        f"trainer.partial_rollout={str(partial).lower()}"])
    trainer = RecordingTrainer()
    fleet = EngineFleet(OnRolloutPool(rollout_settings(spec), trainer))
    events.clear()
    fleet.sync("step_1")
    assert trainer.calls[-1] == ("sync_weights", "step_1", [0], False)  # to engine 0 alone
    pauses = [("pause", e) for e in range(3)] + [("continue", e) for e in range(3)]
    assert events == pauses + [("pushed", 0, "step_1")]
    assert fleet.versions == {0: "step_1", 1: None, 2: None}
    # The generation that meets the restarted server relaunches it and pushes it the latest weights, to it alone and
    # whole, whatever else is down; then its share goes again.
    events.clear()
    restarts.append(1)
    requests = [GenerationRequest((1,), SamplingSpec(max_new_tokens=1)) for _ in range(3)]
    assert len(fleet.generate(requests)) == 3
    assert trainer.calls[-2:] == [("connect_engines", [(2, "http://server-2", (("n0", "cpu"),))]),
                                  ("sync_weights", "step_1", [2], True)]
    assert events == [("relaunch", 2), ("pushed", 2, "step_1")] and fleet.versions[2] == "step_1"
    # A server that refused part of the push (rank 0 leaves it out) but lives gets a new group and the weights whole
    # at once: its group's stream is out of step.
    refused = iter([[0]])
    trainer.sync_weights = lambda version, engines=None, fresh=False: (
        trainer.calls.append(("sync_weights", version, engines, fresh)) or SyncReport(next(refused, [])))
    events.clear()
    fleet.sync("step_2")
    assert trainer.calls[-3:] == [("sync_weights", "step_2", [0], False),
                                  ("connect_engines", [(0, "http://server-0", (("n0", "cpu"),))]),
                                  ("sync_weights", "step_2", [0], True)]
    assert ("relaunch", 0) in events and events[-1] == ("pushed", 0, "step_2") and fleet.versions[0] == "step_2"
    # A server that goes down during the push (rank 0 says which) is not marked as holding the version; after a
    # restart, that ends the run: a re-sync is not retried without bound.
    trainer.sync_weights = lambda version, engines=None, fresh=False: gone.update(engines) or SyncReport(list(engines))
    events.clear()
    fleet.sync("step_3")
    assert [event for event in events if event[0] == "pushed"] == [] and fleet.versions[0] == "step_2"
    restarts.append(1)
    with pytest.raises(ServerUnavailable, match=r"rollout engines \[2\] went down again"):
        fleet.generate(requests)


@pytest.mark.parametrize("partial", [True, False])
def test_a_push_pauses_the_servers_and_continues_them(tmp_path, monkeypatch, partial):
    """The servers hold their generation while the weights change, bucket after bucket, and go on after: with
    trainer.partial_rollout they abort what is in flight (the engines send it again), without it the engines first
    let theirs finish (tests/rollout/test_sglang.py shows both)."""
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.driver.engine_fleet import EngineFleet, OnRolloutPool

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)]))
    calls = tmp_path / "calls.jsonl"

    class Trainer(RecordingTrainer):
        def sync_weights(self, version, engines=None, fresh=False) -> SyncReport:
            seen = [json.loads(line)["path"] for line in calls.read_text().splitlines()] if calls.exists() else []
            self.calls.append(("sync_weights", version, seen))
            return SyncReport(full=fresh)

    spec = load_spec(str(REPO_ROOT / "configs/quickstart.yaml"), [
        f"model.path={REPO_ROOT / 'configs/quickstart/model'}", "placement.gpus_per_node=1",
        "placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1",
        "rollout.engine=sglang", f"rollout.sglang.python={sys.executable}", "rollout.sglang.startup_timeout_s=60",
        f"rollout.sglang.extra_args.fake-record={calls}", f"trainer.run_dir={tmp_path}", "trainer.mode=one_step_off",
        f"trainer.partial_rollout={str(partial).lower()}"])
    trainer = Trainer()
    fleet = EngineFleet(OnRolloutPool(rollout_settings(spec), trainer))
    try:
        assert fleet.backend.hosts[0].engine.partial_rollout is partial
        fleet.sync("step_1")
    finally:
        fleet.shutdown()
    paths = [json.loads(line)["path"] for line in calls.read_text().splitlines()] if calls.exists() else []
    # Paused before each push (the initial one too), continued after it.
    assert [call[2] for call in trainer.calls[1:]] == [
        ["/pause_generation"], ["/pause_generation", "/continue_generation", "/pause_generation"]]
    assert paths == ["/pause_generation", "/continue_generation"] * 2


class _CountingRanks:
    def __init__(self) -> None:
        self.released = 0

    def engine_ranks(self) -> list[int]:
        return [0, 1]

    def release_rollout_memory(self) -> None:
        self.released += 1


def test_engines_with_no_device_memory_to_give_back_are_not_called_to_release_it():
    sleeping, local_on_cpu = _CountingRanks(), _CountingRanks()
    for _ in range(3):
        engine_fleet.InTrainerRanks(sleeping).release_memory()
        engine_fleet.InTrainerRanks(local_on_cpu, sleeps=False).release_memory()
    assert (sleeping.released, local_on_cpu.released) == (3, 0)


def test_an_engine_that_joins_takes_no_sample_before_its_first_push_even_from_a_generation_under_way():
    """Async generation goes on while the pool grows: the new engine is in the backend's list (its server up, with
    the checkpoint's weights) before the fleet pushes to it. A generation started in that window spreads its
    requests over the engines that hold the trained weights only; once pushed, the new one takes its share."""
    from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, SamplingSpec

    class Ranks:
        owner = threading.RLock()

        def sync_weights(self, version, engines=None, fresh=False):
            pushes.append((version, list(engines), fresh))
            if engines == [2]:
                during.extend(fleet.generate(requests))  # and one as its first push is under way
            return SyncReport()

    class Backend:
        ranks = Ranks()
        engines = [0, 1]
        count = property(lambda self: len(self.engines))

        def generate(self, shares, progress=None):
            served.append(sorted(shares))
            return {engine: [GenerationResult(i, 0, (1,), (0.0,), "length") for i in range(len(share))]
                    for engine, share in shares.items()}

        def add(self, count):
            self.engines = [0, 1, 2]
            during.extend(fleet.generate(requests))  # a generation under way as the engine joins
            return [2]

        def pause(self, engines):
            return list(engines)

        def resume(self, engines):
            pass

        def pushed(self, version, engines):
            pass

    pushes, served, during = [], [], []
    requests = [GenerationRequest((i,), SamplingSpec(max_new_tokens=1)) for i in range(6)]
    fleet = engine_fleet.EngineFleet(Backend())
    assert pushes == [(engine_fleet.INITIAL_VERSION, [0, 1], True)]  # the starting engines' first push
    assert fleet.grow(1) == [2]
    assert served == [[0, 1], [0, 1]] and [r.request_index for r in during] == list(range(6)) * 2
    assert pushes[-1][1:] == ([2], True)
    fleet.generate(requests)
    assert served[-1] == [0, 1, 2]
