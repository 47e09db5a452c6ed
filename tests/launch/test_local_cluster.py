"""Several nodes for real, on one machine: launch/local_cluster.sh's Ray nodes (127.0.0.2, .3, .4, 2 CPUs each) and
Slurm (slurmctld, slurmdbd on MariaDB, a slurmd per node in a UTS namespace of its own), one cluster for the file.

- the quickstart learns with its ranks on two nodes, as Ray's own state shows, meeting at rank 0's node address;
- disaggregated, the rollout pool gets the third node, and holds the trained weights at every step (the on-policy
  check: the engine's log-probs equal the actor's, step after step), each trainer node pushing to its share;
- nodes lost mid-run: the ranks restart on the spare node from the last checkpoint (trainer.max_restarts=1), and
  the next loss, past max_restarts, stops the run in one line naming the node and the checkpoint, nothing of it left
  running;
- launch/submit.sh --backend slurm: Ray across the allocation, the job learns, squeue and sacct show it; scancel
  mid-run stops it in order, its last complete checkpoint intact and nothing left on any node;
- launch/submit.sh --backend ray runs the same job on the same cluster.
Where the machine cannot host the cluster (no root for Slurm's packages), local_cluster.sh says why in one line,
and the tests that need that part skip with it.
"""
from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.processes import command, descendants

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER = REPO_ROOT / "launch" / "local_cluster.sh"
STATE = Path(f"/tmp/rlmc-{os.getpid()}")  # short: Ray's socket paths must fit in 107 characters
NODES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # node i at 127.0.0.(i + 2); node 0 is Ray's head
LEARNED = re.compile(r"validation: val/next_digit/score/mean ([\d.]+) \(step 0, before training\) -> ([\d.]+) "
                     r"\(step 150\)")
PLACED = re.compile(r"^trainer: \d+ ranks? on \d+ nodes?: (.*); rendezvous ([\d.]+):(\d+)(?:; rollout pool: .*?: (.*))?$",
                    re.MULTILINE)


def _free_run(first: int, count: int) -> bool:
    for port in range(first, first + count):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.2", port))
            except OSError:
                return False
    return True


class Cluster:
    def __init__(self, state: Path) -> None:
        # Ports of their own, away from a cluster a developer runs with the defaults and from another suite's.
        # local_cluster.sh takes about 120 ports from its base, and a Slurm job's Ray 60 more from base + 1700.
        base = next(b for b in random.sample(range(21000, 24000, 100), 30)
                    if _free_run(b, 120) and _free_run(b + 1700, 60))
        self.env = {**os.environ, "RLM_CLUSTER_DIR": str(state), "RLM_CLUSTER_PORT": str(base),
                    "RLM_CLUSTER_WORKER_PORT": str(random.randrange(11000, 14000, 200)),
                    "RLM_VENV": str(Path(sys.executable).parent.parent)}
        self.state = state

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(CLUSTER), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=REPO_ROOT)

    def use(self) -> dict[str, str]:
        """The environment `eval "$(local_cluster.sh env)"` gives a shell."""
        exported = self.run("env").stdout
        env = dict(self.env)
        for line in exported.splitlines():
            for assignment in line.removeprefix("export ").split():
                name, value = assignment.split("=", 1)
                env[name] = value.replace("$PATH", os.environ["PATH"])
        return env

    @property
    def no_slurm(self) -> str | None:
        why = self.state / "no-slurm"
        return why.read_text().strip() if why.exists() else None

    def restart_nodes(self, *addresses: str) -> None:
        for address in addresses:
            assert self.run("start-node", str(NODES.index(address))).returncode == 0
        _wait_for(lambda: len(_ray_nodes(self.use())) == len(NODES), 60, "the nodes back in the cluster")


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(STATE)
    started = time.monotonic()
    up = cluster.run("up", "--nodes", str(len(NODES)), "--cpus-per-node", "2")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        print(f"local cluster up in {time.monotonic() - started:.1f} s:\n{up.stdout}")
        yield cluster
    finally:
        down = cluster.run("down")
        assert down.returncode == 0, down.stderr
        assert not STATE.exists() and _cluster_processes() == []  # nothing of it left, on any node


@pytest.fixture
def slurm(cluster):
    if cluster.no_slurm:
        pytest.skip(cluster.no_slurm)
    return cluster


def _wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


STATE_QUERY = """
import json, os
from ray.util.state import list_actors, list_nodes
address = os.environ["RLM_RAY_DASHBOARD"]
nodes = {n.node_id: n.node_ip for n in list_nodes(address=address, detail=True) if n.state == "ALIVE"}
actors = [{"class_name": a.class_name, "state": a.state, "node_id": a.node_id, "repr_name": a.repr_name or "",
           "job_id": a.job_id, "placement_group_id": a.placement_group_id or ""}
          for a in list_actors(address=address, detail=True, limit=10000)]
print(json.dumps([nodes, actors]))
"""


def _ray_state(env: dict[str, str]) -> tuple[dict[str, str], list[SimpleNamespace]]:
    """Ray's own record of the cluster (its state API, through the head's dashboard): the alive nodes' IPs by id, and
    every actor. In a process of its own, which presents the cluster's token (Ray reads its auth mode once)."""
    query = subprocess.run([sys.executable, "-c", STATE_QUERY], env=env, capture_output=True, text=True, timeout=60)
    assert query.returncode == 0, query.stderr[-2000:]
    nodes, actors = json.loads(query.stdout.splitlines()[-1])
    return nodes, [SimpleNamespace(**actor) for actor in actors]


def _ray_nodes(env: dict[str, str]) -> dict[str, str]:
    return _ray_state(env)[0]


def _train(env: dict[str, str], run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["rlm", "train", "configs/quickstart.yaml", f"trainer.run_dir={run_dir}", *overrides],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def _placed(output: str) -> tuple[list[str], str, int, list[str]]:
    """(each rank's node, the rendezvous address and port, the rollout pool's nodes) from the run's placement line."""
    found = PLACED.search(output)
    assert found, output[-3000:]
    by_rank = {}
    for address, first, last in re.findall(r"([\d.]+) \(ranks? (\d+)(?:-(\d+))?\)", found.group(1)):
        by_rank.update({rank: address for rank in range(int(first), int(last or first) + 1)})
    rollout = re.findall(r"([\d.]+) \(", found.group(4) or "")
    return [by_rank[r] for r in sorted(by_rank)], found.group(2), int(found.group(3)), rollout


def _cluster_processes() -> list[int]:
    """Every live process of this file's cluster, on any of its nodes (all of them this machine, beside the other test
    worker's processes): those carrying one of its nodes' marks (local_cluster.sh gives each node's Ray and Slurm
    daemons one, and Ray's workers inherit their raylet's), and everything below them (a Slurm job's steps)."""
    marked = f"RLM_SESSION_MARK=local-cluster-{STATE.name}-node".encode()
    roots = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(variable.startswith(marked) for variable in environ):
                roots.append(int(entry.name))
    found = set(roots)
    for pid in roots:
        found.update(descendants(pid))
    return sorted(found)


def _nothing_left_of_runs() -> list[str]:
    """Processes of a run still alive on the cluster's nodes: rank actors, pool hosts, servers."""
    lines = [command(pid) for pid in _cluster_processes()]
    return [line for line in lines if line.startswith(("ray::RankHost", "ray::Member"))
            or "rlmegatron.rollout.local_server" in line or "sglang.launch_server" in line]


def test_the_rollout_pool_gets_a_node_of_its_own_and_an_engine_that_joins_gets_a_placement_group_and_the_weights(
        cluster, tmp_path):
    """A disaggregated job on the cluster: the rollout pool's host on the third node, the two trainer ranks on the
    other two. The on-policy check stops the run when an engine's log-prob of a sampled token is off the actor's by
    more than float32 rounding, so the engines hold exactly the trained weights at every step: the pool's from the
    first, and the one `rlm pool add 1` adds mid-run (its host a Ray actor on a placement group of its own, which
    goes with the run) from the step it joins."""
    from rlmegatron.driver.pool_control import request

    env, run_dir = cluster.use(), tmp_path / "run"
    process = subprocess.Popen(
        ["rlm", "train", "configs/quickstart.yaml", f"trainer.run_dir={run_dir}", "placement.nnodes=2",
         "placement.gpus_per_node=1", "placement.mode=disaggregate", "placement.rollout_nnodes=1",
         "placement.rollout_gpus_per_node=1", "placement.rollout_max_engines=2", "trainer.total_steps=8",
         "trainer.on_policy_check=1e-5", "trainer.test_freq=-1", "trainer.val_before_train=false", "~data.val_files",
         "trainer.log_freq=1", "tracking.backends=[console]"],
        env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, asked = [], False
    for line in process.stdout:
        lines.append(line)
        if not asked and re.match(r"pool/engines\s+1", line):
            request(str(run_dir), "add", 1)
            asked = True
    code = process.wait(timeout=300)
    output = "".join(lines)
    assert code == 0, output[-3000:]
    joined = re.search(r"rollout pool: rlm pool add: engine\(s\) \[1\] joined with the weights of step_(\d+); 2 "
                       r"engines", output)
    assert joined and int(joined.group(1)) < 8, output[-3000:]
    engines = [int(n) for n in re.findall(r"pool/engines\s+(\d+)", output)]
    assert engines[0] == 1 and engines[-1] == 2 and sorted(engines) == engines
    assert "trained steps 1-8 (8 steps)" in output
    trainer_nodes, _, _, rollout_nodes = _placed(output)
    assert len(rollout_nodes) == 1 and len(set(trainer_nodes + rollout_nodes)) == 3
    # Each trainer node's first rank pushes to its share of the engines: engine 1's weights came from the second
    # node, as its server saw its weight-update group's sender, and the on-policy check held all the same.
    senders = {int(engine): address for log in (run_dir / "logs").glob("*.log") for address, engine in re.findall(
        r"master_address=([\d.]+), master_port=\d+, group_name=rlmegatron_sync_(\d+)_", log.read_text())}
    assert senders == {0: trainer_nodes[0], 1: trainer_nodes[1]}, list((run_dir / "logs").iterdir())
    node_ips, actors = _ray_state(env)
    job = next(a.job_id for a in actors if a.class_name == "RankHost" and (a.repr_name or "").endswith(
        f"rendezvous={PLACED.search(output).group(2)}:{PLACED.search(output).group(3)})"))
    hosts = [a for a in actors if a.job_id == job and a.class_name == "Member"]
    assert len(hosts) == 2 and all(node_ips.get(a.node_id) in NODES for a in hosts)
    assert rollout_nodes[0] in [node_ips.get(a.node_id) for a in hosts]  # the pool's host, where it was placed
    assert len({a.placement_group_id for a in hosts}) == 2  # the pool's, and the joined engine's own
    assert _nothing_left_of_runs() == []


def test_a_placement_the_cluster_cannot_hold_is_one_line_at_once(cluster, tmp_path):
    started = time.monotonic()
    run = _train(cluster.use(), tmp_path / "run", "placement.nnodes=4", "placement.gpus_per_node=1",
                 "data.train_batch_size=16", timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "placement: the trainer needs 4 nodes with 1 CPU each (placement.nnodes=4 x placement.gpus_per_node=1), and "
        "the Ray cluster has 3 such nodes (alive nodes: " + ", ".join(f"{ip} (2 CPU)" for ip in NODES) +
        "). Start more nodes (or nodes with more devices), or ask for fewer")
    assert "Traceback" not in run.stderr and time.monotonic() - started < 60


def _lose_rank_nodes_mid_run(cluster, env, run_dir: Path) -> tuple[str, list[str], int]:
    """Trains with a checkpoint every 20 steps and trainer.max_restarts=1, stopping outright (every Ray process of it,
    and all they started, SIGKILLed) the node of a rank that is not on the head after step 30, then, once the ranks
    restarted, the other worker node after step 50; returns (output, the two nodes' addresses, exit code)."""
    process = subprocess.Popen(["rlm", "train", "configs/quickstart.yaml", f"trainer.run_dir={run_dir}",
                                "placement.nnodes=2", "placement.gpus_per_node=1", "trainer.save_freq=20",
                                "trainer.total_steps=60", "trainer.test_freq=-1", "trainer.val_before_train=false",
                                "~data.val_files", "trainer.max_restarts=1"], env=env, cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    victims: list[str] = []
    for line in process.stdout:
        lines.append(line)
        restarted = "Restarting the trainer ranks" in "".join(lines)
        if (line.startswith("step 30 ") and not victims) or (line.startswith("step 50 ") and restarted
                                                                  and len(victims) == 1):
            placements = [_placed(match.group(0))[0] for match in PLACED.finditer("".join(lines))]
            victims.append(next(ip for ip in placements[-1] if ip != NODES[0]))
            stopped = cluster.run("stop-node", str(NODES.index(victims[-1])))
            assert stopped.returncode == 0, stopped.stderr
    code = process.wait(timeout=300)
    return "".join(lines), victims, code


def test_a_lost_node_is_replaced_by_the_spare_and_a_second_past_max_restarts_stops_the_run_in_one_line(
        cluster, tmp_path):
    """The first node lost: the ranks restart on the spare from the last checkpoint. The second, with no restart
    left: the run stops in one line naming the node and the last complete checkpoint, nothing of it left running."""
    env, run_dir = cluster.use(), tmp_path / "run"
    output, victims, code = _lose_rank_nodes_mid_run(cluster, env, run_dir)
    try:
        assert len(victims) == 2 and code == 3, output[-3000:]
        first, second = victims
        assert re.search(rf"trainer rank \d on node {re.escape(first)} is gone", output), output[-3000:]
        # Said whether or not Ray's GCS has noticed yet: a raylet that takes no connection is a lost node.
        assert f"the trainer's node {first} left the Ray cluster; waiting up to" in output, output[-3000:]
        assert f"Restarting the trainer ranks (1 of trainer.max_restarts=1) from {run_dir}/checkpoints/step_20" in output
        placements = [_placed(match.group(0))[0] for match in PLACED.finditer(output)]
        assert len(placements) == 2 and first in placements[0] and first not in placements[1]
        assert set(placements[1]) <= set(NODES) and len(set(placements[1])) == 2 and second in placements[1]
        # The last line: the driver leaves Ray before it, so nothing Ray forwards from the cluster's raylets (the dead
        # node's clean-up, a raylet's state dump) comes after it.
        last = output.strip().split("\n")[-1]
        assert re.fullmatch(rf"training stopped: step \d+: trainer rank \d on node {re.escape(second)} is gone: its "
                            rf"process or its node ended \(Ray: \w+\)\. No checkpoint is written for this step; the "
                            rf"last complete one is {re.escape(str(run_dir))}/checkpoints/step_40 \(the ranks were "
                            rf"restarted 1 time\(s\) already: trainer\.max_restarts=1\)", last), last
        assert "Traceback" not in output
        assert _nothing_left_of_runs() == []
        node_ips, actors = _ray_state(env)
        assert not [a for a in actors if a.class_name == "RankHost" and a.state == "ALIVE"]
    finally:
        cluster.restart_nodes(*victims)


def _submit(env: dict[str, str], *args: str) -> str:
    submitted = subprocess.run(["bash", "launch/submit.sh", *args], env=env, cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return submitted.stdout + submitted.stderr


def _slurm_job(env: dict[str, str], run_dir: Path, *overrides: str) -> tuple[str, Path]:
    said = _submit(env, "--backend", "slurm", "--nodes", "2", "--gpus-per-node", "1", "--config",
                   "configs/quickstart.yaml", "--", f"trainer.run_dir={run_dir}", *overrides)
    job = re.search(r"Submitted batch job (\d+)", said).group(1)
    return job, REPO_ROOT / "runs" / "slurm" / f"rlm-quickstart-{job}.out"


def _slurm(env: dict[str, str], *command: str) -> str:
    return subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout


def _slurm_ended(env: dict[str, str], job: str, timeout_s: float) -> None:
    _wait_for(lambda: not _slurm(env, "squeue", "-h", "-j", job).strip(), timeout_s, f"Slurm job {job}'s end")


def _sacct_states(env: dict[str, str], job: str) -> dict[str, str]:
    rows = _slurm(env, "sacct", "-n", "-P", "-j", job, "-o", "JobID,State").splitlines()
    return dict(row.split("|") for row in rows)


def test_a_slurm_job_brings_up_ray_on_its_nodes_and_learns(slurm, tmp_path):
    env = slurm.use()
    run_dir = tmp_path / "run"
    job, out = _slurm_job(env, run_dir)
    queued = _slurm(env, "squeue", "-h", "-j", job, "-o", "%i %D")
    _slurm_ended(env, job, 300)
    output = out.read_text()
    assert queued.split() in ([job, "2"], []), queued  # squeue showed it on 2 nodes, unless it was over already
    learned = LEARNED.search(output)
    assert learned and float(learned.group(2)) >= 0.8, output[-3000:]
    nodes, rendezvous, *_ = _placed(output)
    assert len(set(nodes)) == 2 and set(nodes) <= set(NODES) and rendezvous == nodes[0]
    assert _wait_for(lambda: _sacct_states(env, job).get(job) == "COMPLETED", 30, "sacct's record")
    assert (run_dir / "checkpoints" / "step_150").is_dir() and (run_dir / "mlflow.db").is_file()
    assert _nothing_left_of_runs() == [] and not _slurm_ray_left(env)


def _slurm_ray_left(env: dict[str, str]) -> list[str]:
    """Processes of the Ray a Slurm job started (its files are under RAY_TMPDIR): none once the job ended."""
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and env["RAY_TMPDIR"] in command(int(entry.name)):
            left.append(command(int(entry.name)))
    return left


def test_scancel_stops_a_slurm_job_in_order_keeping_its_last_checkpoint(slurm, tmp_path):
    from rlmegatron.checkpoint import CheckpointManager

    env = slurm.use()
    run_dir = tmp_path / "run"
    job, out = _slurm_job(env, run_dir, "trainer.save_freq=20")
    _wait_for(lambda: out.exists() and re.search(r"^step 30 ", out.read_text(), re.MULTILINE), 240, "step 30")
    subprocess.run(["scancel", job], env=env, check=True)
    _slurm_ended(env, job, 90)
    output = out.read_text()
    # Slurm signals every process of the job at once: the driver's SIGTERM (`interrupted`), or first the loss of a
    # rank whose node's Ray the cancellation stopped; either way one line naming the last complete checkpoint.
    said = re.search(r"^(?:interrupted; workers and engines stopped; last complete checkpoint: |training stopped: "
                     r"step \d+: trainer rank \d on node [\d.]+ is gone: .* the last complete one is )(\S+)$", output,
                     re.MULTILINE)
    assert said, output[-3000:]
    assert "Traceback" not in output
    latest = CheckpointManager(str(run_dir)).latest()
    assert latest is not None and said.group(1) == str(latest) and latest.name in ("step_20", "step_40")
    assert _wait_for(lambda: _sacct_states(env, job).get(job, "").startswith("CANCELLED"), 30, "sacct's record")
    assert _nothing_left_of_runs() == [] and not _slurm_ray_left(env)


def test_the_quickstart_submitted_to_the_cluster_learns_with_its_ranks_on_two_nodes(cluster, tmp_path):
    """`launch/submit.sh --backend ray` on the cluster: the quickstart learns (validation 0 -> 0.8 or more) with its
    two ranks on two nodes. (The other runs here start `rlm train` with RAY_ADDRESS set, the other way in.)"""
    env = {**cluster.use()}
    env["RAY_ADDRESS"] = env["RLM_RAY_DASHBOARD"]  # ray job submit talks to the dashboard
    run_dir = tmp_path / "run"
    started = time.monotonic()
    output = _submit(env, "--backend", "ray", "--nodes", "2", "--gpus-per-node", "1", "--config",
                     "configs/quickstart.yaml", "--", f"trainer.run_dir={run_dir}")
    wall_s = time.monotonic() - started
    assert "succeeded" in output, output[-3000:]
    learned = LEARNED.search(output)
    assert learned and float(learned.group(1)) == 0.0 and float(learned.group(2)) >= 0.8, output[-3000:]
    assert (run_dir / "checkpoints" / "step_150").is_dir()
    nodes, rendezvous, port, _ = _placed(output)
    # Ray's own record: the two rank actors of this run (their process group met at this rendezvous) ran on two
    # distinct nodes of the cluster, each at the address its node was started with, rank 0 where the group met.
    node_ips, actors = _ray_state(cluster.use())
    ranks = {int(re.search(r"rank=(\d+)", a.repr_name).group(1)): a for a in actors
             if a.class_name == "RankHost" and f"rendezvous={rendezvous}:{port}" in (a.repr_name or "")}
    assert sorted(ranks) == [0, 1]
    where = [node_ips[ranks[rank].node_id] for rank in (0, 1)]
    assert where == nodes and len(set(where)) == 2 and set(where) <= set(NODES)
    assert rendezvous == where[0]
    assert _nothing_left_of_runs() == []
    print(f"multi-node quickstart: {wall_s:.1f} s wall (submitted), ranks on {where}, rendezvous {rendezvous}:{port}")


def test_an_engine_spanning_two_nodes_runs_a_process_on_each_and_both_take_every_push(cluster, tmp_path):
    """rollout.tensor_parallel_size=2 over two rollout nodes of one GPU (CPU) each: each node's host launches that
    node's server process with --nnodes/--node-rank and node 0's address as --dist-init-addr, and both processes join
    the weight-update group and receive every bucket. The server is the loopback SGLang stand-in (its node 0 hands
    each weight update on to the other node, as SGLang's own does to every node's schedulers); its command lines go
    through SGLang 0.5.23's own ServerArgs."""
    from tests.driver.test_train import FAKE_SGLANG
    from tests.helpers.sglang_args import parse_with_sglang

    # The rollout hosts are Ray workers of the cluster, started without this test's PYTHONPATH: the interpreter the
    # spec names (rollout.sglang.python) puts the stand-in first, before the installed sglang.
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={FAKE_SGLANG}:{REPO_ROOT} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    calls = tmp_path / "server.calls"
    run_dir = tmp_path / "run"
    run = _train(cluster.use(), run_dir, "rollout.engine=sglang", f"rollout.sglang.python={python}",
                 "rollout.sglang.startup_timeout_s=120", f"rollout.sglang.extra_args.fake-record={calls}",
                 "placement.mode=disaggregate", "placement.nnodes=1", "placement.gpus_per_node=1",
                 "placement.rollout_nnodes=2", "placement.rollout_gpus_per_node=1", "rollout.tensor_parallel_size=2",
                 "trainer.total_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "~data.val_files", "trainer.save_freq=-1")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    trainer_nodes, _, _, rollout_nodes = _placed(output)
    assert len(rollout_nodes) == 2 and len(set(trainer_nodes + rollout_nodes)) == 3
    # Each node's process: on its node's address, node 0's as the rendezvous.
    launched = {}
    for log in (run_dir / "logs").glob("sglang_*_node*.log"):
        argv = json.loads(re.search(r"^fake sglang server argv (.*)$", log.read_text(), re.MULTILINE).group(1))
        flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        launched[int(flags["--node-rank"])] = (argv, flags)
    assert sorted(launched) == [0, 1], list((run_dir / "logs").iterdir())
    for node_rank, (_, flags) in launched.items():
        assert flags["--nnodes"] == "2" and flags["--tp-size"] == "2"
        assert flags["--host"] == rollout_nodes[node_rank]
        assert flags["--dist-init-addr"].rsplit(":", 1)[0] == rollout_nodes[0]
    # The command lines, as launched (less the stand-in's own --fake-* flags), through SGLang's own parser.
    commands = [[arg for i, arg in enumerate(argv) if not (arg.startswith("--fake-") or
                                                          (i and argv[i - 1].startswith("--fake-")))]
                for argv, _ in launched.values()]
    results, stderr = parse_with_sglang(commands)
    assert results == [[command, "ok"] for command in commands], stderr[-2000:]
    # Both nodes' processes joined every weight-update group and received every bucket of every push, the same.
    records = [json.loads(line) for line in calls.read_text().splitlines()]
    joined = [r["node_rank"] for r in records if r["path"] == "/init_weights_update_group"]
    assert sorted(joined) == [0, 1]
    received: dict[int, dict[str, dict[str, str]]] = {0: {}, 1: {}}
    for record in records:
        if record["path"] == "/update_weights_from_distributed":
            received[record["node_rank"]].setdefault(record["version"], {}).update(record["digests"])
    assert received[0] == received[1] and len(received[0]) >= 4  # the initial weights and one push a step
    digests = [tuple(sorted(version.items())) for version in received[0].values()]
    assert len(set(digests)) == len(digests)  # every push brought weights the engines did not hold yet
