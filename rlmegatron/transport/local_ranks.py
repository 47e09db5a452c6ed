"""Run a function on N local ranks (gloo on CPU, nccl on GPUs) with a free port, a timeout and per-rank errors.

Used by the tests, the converter's `--nproc`, and anything else that needs a
process group without torchrun. A rank that raises, crashes or hangs fails the
whole call within `timeout_s`, and the error names every rank that went wrong.
"""
from __future__ import annotations

import contextlib
import io
import os
import queue as queue_lib
import signal
import time
import traceback
from typing import Any, Callable

import torch

from rlmegatron.errors import UserError, user_error_in
from rlmegatron.runtime.distributed import Device, destroy_distributed, free_port, init_distributed
from rlmegatron.transport.fork_server import fork_server


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not finish in time."""


class RankDied(RankFailure):
    """A rank's process (a local one, or a Ray actor: its node too may have gone) ended while the driver waited for
    it."""


class RankUserError(RankFailure, UserError):
    """The first rank to fail did so on a user's mistake (its peers then fail in their collectives): the message
    is the mistake's, said once however many ranks made it; every rank's traceback is its cause (RLM_DEBUG=1)."""


def rank_threads(device: str, world_size: int) -> int:
    """Torch threads per rank. CPU ranks share the machine's cores (a local CPU cluster): each takes its share, as
    more threads only fight over the same cores and fewer leave some idle (one rank on two cores). OMP_NUM_THREADS,
    where it is set, is the share its caller gives each process (torchrun sets it to 1, as torch's own default reads
    it), and wins: on a machine that runs other work too, the cores are not all the job's."""
    if device != "cpu":
        return 1
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // world_size)


def _serialize(obj: Any) -> bytes:
    # torch.save, not the multiprocessing pickler: torch's shared-memory tensor
    # reduction would hand the parent file descriptors of a process that exits.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _rank_main(fn, args, rank, world_size, port, device, threads, environment, results):
    # Own process group, so cleanup also reaches helpers the rank starts (dist_checkpointing's Manager).
    os.setpgrp()
    # The caller's environment as it is now, as a spawned rank would have it (the fork server's is its first caller's).
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    try:
        init_distributed(device)
        value = fn(*args)
        destroy_distributed()
        results.put((rank, True, _serialize(value), None))
    except BaseException as error:  # noqa: BLE001 - every failure must reach the parent as text
        mistake = user_error_in(error)
        results.put((rank, False, traceback.format_exc(), None if mistake is None else str(mistake)))


def stop_processes(procs, grace_s: float) -> None:
    """Let finished ranks exit on their own, then end each rank's whole process group."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            # The process itself too: a rank still starting (importing, on a loaded machine) has no group yet, and
            # left alive it would wait for its peers forever and keep the caller from exiting.
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(proc.pid, sig)
        for proc in procs:
            proc.join(timeout=5)


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    device: Device = "cpu",
    timeout_s: float = 300.0,
) -> list[Any]:
    """Call `fn(*args)` on `nprocs` fresh processes joined in one process group; return each rank's value.

    `fn` must be importable by name (a module-level function): ranks are forked from
    multiprocessing's fork server, never from the caller, which may have run torch.
    """
    ctx = fork_server(device=device)
    results = ctx.Queue()
    port = free_port()
    threads = rank_threads(device, nprocs)
    procs = [
        # Not daemonic: dist_checkpointing starts its own writer processes inside each rank.
        ctx.Process(target=_rank_main, args=(fn, args, rank, nprocs, port, device, threads, dict(os.environ), results))
        for rank in range(nprocs)
    ]
    for proc in procs:
        proc.start()

    values: dict[int, Any] = {}
    errors: dict[int, str] = {}  # in the order the failures were seen: the first is the cause
    mistakes: dict[int, str] = {}  # the user errors among them
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(errors) < nprocs:
            try:
                rank, ok, payload, mistake = results.get(timeout=0.5)
            except queue_lib.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} before reporting"
                    deadline = min(deadline, time.monotonic() + 5.0)
                if time.monotonic() > deadline:
                    break
                continue
            if ok:
                values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
                if mistake is not None:
                    mistakes[rank] = mistake
                # Peers are usually stuck in a collective with the failed rank; give
                # them a moment to report their own error, then stop waiting.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        stop_processes(procs, grace_s=30.0 if len(values) == nprocs else 0.0)
        results.close()

    if errors or len(values) < nprocs:
        lines = [f"{len(errors) or nprocs - len(values)} of {nprocs} ranks failed ({fn.__qualname__}):"]
        for rank in range(nprocs):
            if rank in errors:
                lines.append(f"--- rank {rank} ---\n{errors[rank].rstrip()}")
            elif rank not in values and errors:
                lines.append(f"--- rank {rank} --- stopped: still waiting (likely on a collective) after another rank failed")
            elif rank not in values:
                lines.append(f"--- rank {rank} --- did not finish within {timeout_s:.0f} s (hung)")
        failure = RankFailure("\n".join(lines))
        if errors and next(iter(errors)) in mistakes:
            raise RankUserError("\n".join(dict.fromkeys(mistakes[rank] for rank in sorted(mistakes)))) from failure
        raise failure
    return [values[rank] for rank in range(nprocs)]
