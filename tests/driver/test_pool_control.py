"""The rollout pool grows and shrinks at step boundaries (rlmegatron/driver/pool_control.py): requests from `rlm pool`
cut to placement.rollout_min_engines .. rollout_max_engines, rollout.autoscale's decisions from the share of the step
spent waiting for the rollout, and a request to a directory no run uses refused in one line."""
import subprocess
import sys

import pytest

from rlmegatron.driver import pool_control
from rlmegatron.driver.pool_control import PoolControl, request

HOLD = ("import sys, time\nfrom rlmegatron.checkpoint.run_dir import run_dir_lock\nwith run_dir_lock(sys.argv[1]):\n"
        "    print('held', flush=True)\n    time.sleep(120)\n")


@pytest.fixture
def running(tmp_path):
    """`tmp_path` with its lock held by another process, as `rlm train` holds its run directory's."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield tmp_path
    holder.kill()
    holder.wait()


class FakeFleet:
    """The fleet as PoolControl drives it: engines numbered as they join, the last to join leaving first."""

    def __init__(self, count: int) -> None:
        self.versions = dict.fromkeys(range(count), "step_0")
        self.version, self.next = "step_0", count
        self.calls: list = []
        self.joined: list[str] = []
        """The nodes the next `joined_nodes` reports."""

    def joined_nodes(self) -> list[str]:
        joined, self.joined = self.joined, []
        return joined

    @property
    def count(self) -> int:
        return len(self.versions)

    def grow(self, count: int) -> list[int]:
        added = list(range(self.next, self.next + count))
        self.next += count
        self.versions.update(dict.fromkeys(added, self.version))
        self.calls.append(("grow", count))
        return added

    def shrink(self, engines: list[int]) -> None:
        for engine in engines:
            del self.versions[engine]
        self.calls.append(("shrink", engines))


def test_requests_are_taken_once_in_order_and_cut_to_the_bounds(running):
    tmp_path = running
    fleet, said = FakeFleet(1), []
    control = PoolControl(fleet, str(tmp_path), (1, 1, 3), autoscale=False, say=said.append)
    request(str(tmp_path), "add", 5)
    request(str(tmp_path), "remove", 1)
    metrics = control.at_step(None)
    assert fleet.calls == [("grow", 2), ("shrink", [2])]
    assert metrics == {"pool/engines": 2.0, "pool/added": 2.0, "pool/removed": 1.0}
    assert said[0] == ("rollout pool: rlm pool add asked for 5 engine(s) more; 1 run and "
                       "placement.rollout_max_engines=3, so 2 join")
    assert said[1:] == ["rollout pool: rlm pool add: engine(s) [1, 2] joined with the weights of step_0; 3 engines",
                        "rollout pool: rlm pool remove: engine(s) [2] left after their samples; 2 engines"]
    assert list((tmp_path / pool_control.REQUESTS_DIR).iterdir()) == []  # taken once
    assert control.at_step(None)["pool/added"] == 0.0 and len(fleet.calls) == 2
    request(str(tmp_path), "remove", 3)
    control.at_step(None)
    assert fleet.count == 1 and said[-2] == ("rollout pool: rlm pool remove asked for 3 engine(s) fewer; 2 run and "
                                              "placement.rollout_min_engines=1, so 1 leave")


def test_autoscale_adds_when_the_trainer_waited_two_steps_and_removes_after_three_idle_ones(tmp_path):
    fleet = FakeFleet(2)
    control = PoolControl(fleet, str(tmp_path), (1, 2, 3), autoscale=True, say=lambda line: None)

    def step(wait_share: float) -> dict:
        return control.at_step({"timing_s/step": 10.0, "timing_s/wait_rollout": 10.0 * wait_share})

    assert step(0.6)["pool/added"] == 0.0  # one step that waited is not yet a bottleneck
    assert step(0.7) == {"pool/engines": 3.0, "pool/added": 1.0, "pool/removed": 0.0, "pool/wait_share": 0.7}
    assert [step(0.9)["pool/added"] for _ in range(3)] == [0.0, 0.0, 0.0]  # at rollout_max_engines=3
    assert [step(0.05)["pool/removed"] for _ in range(3)] == [0.0, 0.0, 1.0]  # three idle steps: one leaves
    assert fleet.calls == [("grow", 1), ("shrink", [2])]  # the engine that joined last leaves first
    assert [step(0.3)["pool/removed"] for _ in range(4)] == [0.0] * 4  # between the thresholds: no change


def test_rlm_pool_on_a_directory_no_run_uses_is_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "rlmegatron", "pool", "add", "1", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (f"{tmp_path}: no run is training there (no live lock); start it "
                                                   "with rlm train, or name its trainer.run_dir")


@pytest.mark.parametrize("count", ["0", "-1"])
def test_rlm_pool_takes_a_count_of_one_or_more(tmp_path, count):
    run = subprocess.run([sys.executable, "-m", "rlmegatron", "pool", "remove", count, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip() == f"rlm pool remove: COUNT={count}: must be at least 1"


def test_an_engine_that_cannot_join_is_one_line_and_the_run_goes_on(running):
    from rlmegatron.transport.placement import PlacementUnsatisfiable

    class FullCluster(FakeFleet):
        def grow(self, count):
            raise PlacementUnsatisfiable("placement: the rollout needs 1 node with 8 GPU each (1 x 8), and the Ray "
                                         "cluster has 0 such nodes")

    said = []
    control = PoolControl(FullCluster(1), str(running), (1, 1, 2), autoscale=False, say=said.append)
    request(str(running), "add", 1)
    assert control.at_step(None)["pool/engines"] == 1.0
    assert said == ["rollout pool: rlm pool add: no engine could join: placement: the rollout needs 1 node with 8 GPU "
                    "each (1 x 8), and the Ray cluster has 0 such nodes"]


def test_autoscale_adds_an_engine_for_each_node_that_joins_the_cluster_up_to_the_bound(tmp_path):
    fleet, said = FakeFleet(1), []
    control = PoolControl(fleet, str(tmp_path), (1, 1, 2), autoscale=True, say=said.append)
    fleet.joined = ["10.0.0.7", "10.0.0.8"]
    assert control.at_step(None) == {"pool/engines": 2.0, "pool/added": 1.0, "pool/removed": 0.0}
    assert fleet.calls == [("grow", 1)]  # the second node finds the pool at rollout_max_engines=2
    assert said == ["rollout pool: rollout.autoscale (node 10.0.0.7 joined the Ray cluster): engine(s) [1] joined "
                    "with the weights of step_0; 2 engines"]
    fleet.joined = ["10.0.0.9"]
    without = PoolControl(fleet, str(tmp_path), (1, 2, 3), autoscale=False, say=said.append)
    assert without.at_step(None)["pool/added"] == 0.0  # without autoscale a node that joins changes nothing


def test_the_pool_reports_each_node_that_joined_the_ray_cluster_once(monkeypatch):
    from rlmegatron.driver import engine_fleet
    from rlmegatron.transport.placement import Node

    nodes = [Node("a", "10.0.0.1", {}), Node("b", "10.0.0.2", {})]
    monkeypatch.setattr(engine_fleet, "alive_nodes", lambda: list(nodes))
    pool = engine_fleet.OnRolloutPool.__new__(engine_fleet.OnRolloutPool)  # its state, without starting servers
    pool.pool, pool.known_nodes = object(), {"a", "b"}
    assert pool.joined_nodes() == []
    nodes.append(Node("c", "10.0.0.3", {}))
    assert pool.joined_nodes() == ["10.0.0.3"] and pool.joined_nodes() == []
    nodes.pop(0)  # a node that leaves is no join; back, it has a new id (Ray gives it one): a join
    nodes.append(Node("d", "10.0.0.1", {}))
    assert pool.joined_nodes() == ["10.0.0.1"]
    pool.pool = None  # without Ray: no cluster to join
    assert pool.joined_nodes() == []
