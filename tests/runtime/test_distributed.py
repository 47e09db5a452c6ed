"""Megatron's parallel groups on real gloo ranks: rebuilding a layout frees the previous one's groups."""
import os

import torch

from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.runtime import run_ranks


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
