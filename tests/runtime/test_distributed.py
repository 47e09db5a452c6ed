"""Megatron's parallel groups on real gloo ranks: rebuilding a layout frees the previous one's groups."""
import os

import torch

from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.runtime import distributed
from rlmegatron.transport.local_ranks import run_ranks


def _groups_and_threads_per_rebuild(rebuilds: int) -> list[tuple[int, int]]:
    from torch.distributed.distributed_c10d import _world

    from rlmegatron.runtime import init_model_parallel

    counts = []
    for index in range(rebuilds):
        init_model_parallel(L(tp=2) if index % 2 else L(pp=2))
        torch.distributed.barrier()
        counts.append((len(_world.pg_map), len(os.listdir("/proc/self/task"))))
    return counts


def test_rebuilding_the_layout_frees_the_previous_groups_and_their_threads():
    counts = run_ranks(_groups_and_threads_per_rebuild, 2, 6, timeout_s=120)[0]
    groups = [g for g, _ in counts]
    threads = [t for _, t in counts]
    # Each layout makes the same number of groups; before the fix every rebuild added ~20 groups, 3 threads each.
    assert groups[2:] == groups[:2] * 2 and groups[0] > 1, counts
    assert max(threads[2:]) <= max(threads[:2]) + 2, counts


def _layout_switching() -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from torch.distributed.distributed_c10d import _world

    from rlmegatron.runtime import init_model_parallel, layout_scope

    def seen() -> dict:
        total = torch.ones(1) * (torch.distributed.get_rank() + 1)
        torch.distributed.all_reduce(total, group=ps.get_tensor_model_parallel_group())
        with get_cuda_rng_tracker().fork():
            draw = torch.rand(1).item()
        return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                "dp": ps.get_data_parallel_world_size(), "tp_sum": total.item(), "draw": draw}

    actor, reference, critic = L(tp=2), L(), L(pp=2)
    groups = []
    for _ in range(2):  # rebuilding every layout's groups must not pile them up
        init_model_parallel(actor, seed=7, others=[reference, critic, L(tp=2, sequence_parallel=True)])
        groups.append(len(_world.pg_map))
    report = {"groups": groups, "actor": [seen()]}
    with layout_scope(reference):
        report["reference"] = [seen()]
        with layout_scope(critic):
            report["critic"] = [seen()]
        report["reference"].append(seen())
    report["actor"].append(seen())
    # One continuous stream per layout, whatever ran in between: a fresh build draws the same two numbers in a row.
    init_model_parallel(reference, seed=7)
    report["reference_alone"] = [seen(), seen()]
    return report


def test_each_layout_keeps_its_own_groups_and_rng_stream_across_switches():
    reports = run_ranks(_layout_switching, 2, timeout_s=120)
    first = reports[0]
    assert first["groups"][0] == first["groups"][1], first["groups"]
    for rank, report in enumerate(reports):
        assert [(s["tp"], s["pp"], s["dp"]) for s in report["actor"]] == [(2, 1, 1)] * 2
        assert [(s["tp"], s["pp"], s["dp"]) for s in report["reference"]] == [(1, 1, 2)] * 2
        assert [(s["tp"], s["pp"], s["dp"]) for s in report["critic"]] == [(1, 2, 1)]
        # The all-reduce ran over each layout's own TP group: both ranks (1 + 2) at TP=2, this rank alone at TP=1.
        assert [s["tp_sum"] for s in report["actor"]] == [3.0, 3.0]
        assert [s["tp_sum"] for s in report["reference"] + report["critic"]] == [rank + 1.0] * 3
        assert [s["draw"] for s in report["reference"]] == [s["draw"] for s in report["reference_alone"]]
    # TP ranks draw from different model-parallel streams; at TP=1 every rank draws the same.
    assert reports[0]["actor"][0]["draw"] != reports[1]["actor"][0]["draw"]
    assert reports[0]["reference"][0]["draw"] == reports[1]["reference"][0]["draw"]


def test_free_ports_are_picked_below_the_range_outgoing_connections_take_theirs_from(monkeypatch):
    import socket

    low = distributed._ephemeral_low()
    ports = [distributed.free_port() for _ in range(50)]
    assert all(distributed._LOWEST_PORT <= port < low for port in ports), ports
    assert len(set(ports)) > 40  # drawn, not the same few
    for port in ports[:5]:  # each one is free
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    # Where no such range exists below it (a kernel set to start outgoing ports at 20000), the kernel picks.
    monkeypatch.setattr(distributed, "_ephemeral_low", lambda: 20000)
    fallback = distributed.free_port()
    assert fallback >= low
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", fallback))
