"""The driver's round trip to the trainer ranks: one `call_all` of a no-op on 2 CPU ranks, as Ray actors
(placement.transport=ray) and as rank processes (placement.transport=processes), alternating in each round.

    python benchmarks/group_calls.py [--rounds 3] [--calls 300]

Prints, per round, the 1-minute load average and each group's median time per call. A training step makes a few such
calls (generate, the updates, the weight sync, ...), each carrying the step's data on top.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


class Idle:
    def pid(self) -> int:
        return os.getpid()


def median_ms(group, calls: int) -> float:
    group.call_all(Idle.pid)  # built
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        group.call_all(Idle.pid)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    import ray
    from ray.util.placement_group import remove_placement_group

    from rlmegatron.transport.placement import create_pool
    from rlmegatron.transport.rank_processes import RankProcesses
    from rlmegatron.transport.worker_group import RayWorkerGroup

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    pool = create_pool("trainer", 1, 2, "cpu")
    groups = {"ray": RayWorkerGroup(pool, Idle), "processes": RankProcesses("cpu", 2, Idle)}
    try:
        for _ in range(args.rounds):
            medians = {name: f"{median_ms(group, args.calls):.3f} ms" for name, group in groups.items()}
            print(f"load {os.getloadavg()[0]:.2f}: {medians}", flush=True)
    finally:
        for group in groups.values():
            group.shutdown()
        remove_placement_group(pool.placement_group)
        ray.shutdown()


if __name__ == "__main__":
    main()
