"""Run a function on N local ranks (gloo on CPU, nccl on GPUs) with a free port, a timeout and per-rank errors.

Used by the tests, the converter's `--nproc`, and anything else that needs a
process group without torchrun. A rank that raises, crashes or hangs fails the
whole call within `timeout_s`, and the error names every rank that went wrong.
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue as queue_lib
import random
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

import torch

from rlmegatron.errors import UserError, user_error_in
from rlmegatron.runtime.distributed import Device, destroy_distributed, init_distributed
from rlmegatron.runtime.notices import import_notices_off


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not finish in time."""


class RankUserError(RankFailure, UserError):
    """The first rank to fail did so on a user's mistake (its peers then fail in their collectives): the message
    is the mistake's, said once however many ranks made it; every rank's traceback is its cause (RLM_DEBUG=1)."""


# Ray's worker processes listen on 10002-19999 by default; ports are picked above them.
_LOWEST_PORT = 20000


def _ephemeral_low() -> int:
    """The lowest port of the kernel's range for outgoing connections' local ports (Linux's default where it cannot
    be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now; "" probes every interface (a rendezvous other nodes connect to).

    Picked at random below the kernel's ephemeral range, not by binding port 0: a server binds its port a second
    or more after it is picked, and a port from the ephemeral range can meanwhile become the local end of any
    outgoing connection on the machine (gloo's, Ray's, an HTTP client's); the parallel test suite saw a colocated
    SGLang server fail on EADDRINUSE that way. Two pickers may still draw the same port, one time in ~12,000."""
    low = _ephemeral_low()
    draw = random.SystemRandom()  # not the random module's state: a seeded run would pick the same ports everywhere
    for _ in range(64) if low - 1 > _LOWEST_PORT else ():
        port = draw.randint(_LOWEST_PORT, low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no such range here, or all of it taken
        sock.bind((host, 0))
        return sock.getsockname()[1]


_PRELOAD = ["torch", "megatron.core", "transformers", "rlmegatron.runtime.launcher"]


def fork_server(preload: Sequence[str] = (), device: Device = "cpu") -> Any:
    """multiprocessing's forkserver context, its server started now if it is not running: it imports torch,
    Megatron-Core, transformers and `preload` (about 4 s of CPU) in the background, while the caller goes on, and
    ranks forked from it start with all of that imported. `preload` counts only for the call that starts the server.

    Forked from a server that imported them and ran nothing: forking a process that already ran torch (or has
    threads) can deadlock, forking this one cannot."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, *preload])
    # Its imports come before any rank quiets the library notices they print: it starts with them off.
    with environment(PYTHONWARNINGS=",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                                           import_notices_off(device)]))), _ctrl_c_ignored():
        forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def _ctrl_c_ignored() -> Iterator[None]:
    """SIGINT ignored while the fork server starts: it keeps that through exec, so a Ctrl-C during its seconds of
    imports does not print a traceback from it (the driver reports the interrupt and ends it). Its serving loop
    ignores SIGINT anyway, and the ranks it forks inherit that: the driver, not a KeyboardInterrupt in the middle
    of a collective, stops them. Only the main thread may set a handler; elsewhere the server starts as it would."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def environment(**variables: str) -> Iterator[None]:
    """`variables` in this process's environment for the processes started meanwhile, then as they were."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def rank_threads(device: str, world_size: int) -> int:
    """Torch threads per rank. CPU ranks share the machine's cores (a local CPU cluster): each takes its share, as
    more threads only fight over the same cores and fewer leave some idle (one rank on two cores)."""
    return max(1, (os.cpu_count() or 1) // world_size) if device == "cpu" else 1


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
