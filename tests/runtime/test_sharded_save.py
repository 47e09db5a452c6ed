"""save_sharded: a synchronous dist_checkpointing save that starts no interpreter of its own and reads back bitwise."""
import multiprocessing

import torch

from rlmegatron.runtime import ParallelLayout
from rlmegatron.transport.local_ranks import run_ranks


def save_twice_job(workdir: str) -> dict:
    from tests.rank.roles.jobs import make_actor

    before = set(multiprocessing.active_children())
    started = []
    original_start = multiprocessing.process.BaseProcess.start

    def start(process):  # every process this rank starts, whatever the context
        started.append(type(process).__name__)
        return original_start(process)

    multiprocessing.process.BaseProcess.start = start
    try:
        actor = make_actor(ParallelLayout())
        for name in ("first", "second"):
            actor.save_weights(f"{workdir}/{name}")
    finally:
        multiprocessing.process.BaseProcess.start = original_start
    saved = {n: p.detach().clone() for n, p in actor.chunks[0].module.named_parameters()}
    reloaded = make_actor(ParallelLayout())
    reloaded.load_weights(f"{workdir}/second")
    return {"started": started, "left": [type(p).__name__ for p in set(multiprocessing.active_children()) - before],
            "bitwise": all(torch.equal(saved[n], p) for n, p in reloaded.chunks[0].module.named_parameters()),
            "tensors": len(saved)}


def test_a_save_starts_no_spawned_process_and_reloads_bitwise(tmp_path):
    """Megatron-Core's writer would start a multiprocessing Manager (a spawned interpreter importing torch, seconds of
    CPU per rank) on each rank's first save; the writer's own forked file writers, which end with the save, stay."""
    (report,) = run_ranks(save_twice_job, 1, str(tmp_path), timeout_s=300)
    assert report["tensors"] > 0 and report["bitwise"]
    assert report["started"] and "SpawnProcess" not in report["started"], report["started"]
    assert report["left"] == [], report["left"]
