"""Write a Megatron distributed checkpoint (dist_checkpointing) synchronously, without the helper process its writer
starts for the first save of every rank."""
from __future__ import annotations

import os
import queue

import torch


def save_sharded(sharded_state_dict: dict, path: str) -> None:
    """dist_checkpointing.save of `sharded_state_dict` to `path` (made if missing), once every rank is ready.

    Megatron-Core's file writer hands its write results back through a queue from `multiprocessing.Manager()` under
    the spawn context, made on the first save in each process: a fresh interpreter per rank that imports torch to
    unpickle its start-up data, seconds of CPU each (benchmarks/RESULTS.md, "dist_checkpointing's writer queue"). That
    queue is there for an asynchronous save, whose writer runs in another process; rlmegatron's saves are synchronous,
    so the write and the read of its result happen in this process, and a plain in-process queue carries them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # A Megatron-Core without this module global keeps its own queue, whatever it is.
    if hasattr(filesystem_async, "_results_queue") and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sharded_state_dict, path)
